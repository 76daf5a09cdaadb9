"""One checkpoint, whatever its format: a ModelConfig plus a stream of tensors under the canonical names.

The canonical state dict is LlamaForCausalLM's: Hugging Face names, (out_features, in_features) orientation and
the rotate-half rotary layout. `expected_tensor_shapes` (names.py) is the contract between the loaders and the
model; `build_model` turns canonical tensors into a Transformer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Iterable, Iterator, Mapping, Protocol

import torch
from torch.overrides import TorchFunctionMode

from ..config import ModelConfig
from ..errors import CheckpointError
from ..model import Transformer
from .gguf import open_gguf
from .hf import open_safetensors_folder
from .names import checkpoint_tensors, expected_tensor_shapes, model_state_dict, unaccounted_tensors
from .resolve import resolve_checkpoint


class TensorSource(Protocol):
    """Where a format's tensors come from (see hf.SafetensorsTensors and gguf.GGUFTensors)."""

    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Canonical name -> shape of every tensor the file holds, read from headers only."""

    def stored_name(self, name: str) -> str:
        """The name a canonical tensor has in the file, for error messages."""

    def load(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the named tensors one at a time, converted to the canonical layout."""


@dataclass(frozen=True)
class Checkpoint:
    """A resolved local checkpoint: its path, format ("safetensors" or "gguf"), config and tensors."""

    path: Path  # a folder (config.json + safetensors + tokenizer files) or a .gguf file
    format: str
    config: ModelConfig
    source: TensorSource = field(repr=False, compare=False)

    def validate(self) -> None:
        """Raise CheckpointError unless the file holds exactly the model its config describes: every expected
        tensor present with its expected shape, and no tensor the config does not account for (e.g. layers past
        a too-small layer count). Reads headers only; rotary inv_freq buffers and the like are ignored."""
        stored = self.source.shapes()
        for name, want in expected_tensor_shapes(self.config).items():
            label = self._label(name)
            if name not in stored:
                raise CheckpointError(f"{self.path}: missing tensor {label}")
            if tuple(stored[name]) != want:
                raise CheckpointError(
                    f"{self.path}: tensor {label} has shape {tuple(stored[name])}, expected {want} from the config"
                )
        extra = unaccounted_tensors(stored, self.config)
        if extra:
            raise CheckpointError(
                f"{self.path}: tensor {self._label(extra[0])} is not part of the model the config describes "
                f"({self.config.n_layers} layers; {len(extra)} such tensors): the config and the weights disagree"
            )

    def tensors(self, given: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """Validate, then yield (canonical name, CPU tensor) one at a time, so that peak memory stays about one
        copy of the model. safetensors: stored dtype, read from the memory map when yielded. GGUF: F32/F16/BF16
        as stored, quantised types dequantised to float32, Q/K in HF rotary layout. A tensor holding NaN or
        infinity (no trained weight does; a corrupted file may) raises CheckpointError instead of being run.
        given: our parameter names whose tensors are not read (see load_model)."""
        self.validate()
        table = checkpoint_tensors(self.config)
        names = [name for name in expected_tensor_shapes(self.config) if table[name].ours not in given]
        return self._finite(self.source.load(names))

    def _finite(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            # One reduction first: a sum is finite only if every term is; only an overflowing sum of finite
            # values (a half-precision tensor, say) needs the elementwise check.
            if not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
                raise CheckpointError(f"{self.path}: tensor {self._label(name)} holds NaN or infinite values")
            yield name, tensor

    def load_model(self, *, dtype: torch.dtype, device: torch.device | str, given: Collection[str] = ()
                   ) -> Transformer:
        """The model with this checkpoint's weights, in `dtype` on `device` (see build_model). given: our names
        of parameters the caller puts in place itself (a file's own quantized codes, "layers.0.attention.wqkv.weight"):
        neither read nor allocated here, they stay on the meta device."""
        try:
            return build_model(self.config, self.tensors(given), dtype=dtype, device=device, given=given)
        except CheckpointError as error:  # build_model's own messages do not know the file
            if str(self.path) in str(error):
                raise
            raise CheckpointError(f"{self.path}: {error}") from error

    def _label(self, name: str) -> str:
        stored = self.source.stored_name(name)
        return name if stored == name else f"{name} ({stored} in the file)"


def open_checkpoint(ckpt: str | Path | None, *, weights_dir: Path | None = None, progress: bool = True) -> Checkpoint:
    """Resolve `ckpt` (see resolve_checkpoint), read its config and tensor index, and validate the shapes.
    Raises CheckpointError (a ValueError) with a one-line message."""
    path = resolve_checkpoint(ckpt, weights_dir=weights_dir, progress=progress)
    checkpoint = _open_gguf_file(path) if path.is_file() else _open_safetensors_folder(path)
    checkpoint.validate()
    return checkpoint


def _open_gguf_file(path: Path) -> Checkpoint:
    source = open_gguf(path)
    return Checkpoint(path=path, format="gguf", config=source.config, source=source)


def _open_safetensors_folder(path: Path) -> Checkpoint:
    config, source = open_safetensors_folder(path)
    return Checkpoint(path=path, format="safetensors", config=config, source=source)


class _SkipInit(TorchFunctionMode):
    """Skips torch.nn.init's initialisers (every module's reset_parameters calls them). On the meta device they
    would fill nothing, but the first one, the embedding's normal_, imports torch._dynamo (2-3 s)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def meta_model(config: ModelConfig) -> Transformer:
    """The Transformer of `config` on the meta device: its modules and shapes, no memory, nothing initialised."""
    with torch.device("meta"), _SkipInit():
        return Transformer(config)


def build_model(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype,
                device: torch.device | str, given: Collection[str] = ()) -> Transformer:
    """A Transformer with the given canonical-named weights (converted to dtype/device), built on the meta device
    so no random weights are ever allocated and the weights exist in memory once. Parameters named in `given`
    may be absent from `tensors` (they stay on the meta device, for the caller to replace)."""
    model = meta_model(config)
    state = model_state_dict(tensors, config, dtype=dtype, device=device)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m not in given and not (config.tie_word_embeddings and m == "output.weight")]
    if missing or unexpected:
        raise CheckpointError(f"weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.setup_rope()
    return model.eval().requires_grad_(False)
