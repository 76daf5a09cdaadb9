"""GGUF files (llama.cpp): metadata into a ModelConfig, the tensor index under canonical names (names.py holds
the name table), dequantisation and the Q/K rotary un-permutation. The container itself is parsed, with every
length checked, by gguf_file.py.

Facts this module relies on (gguf-py's gguf_reader.py and quants.py, llama.cpp's convert_hf_to_gguf.py):
- GGUF lists dimensions innermost first (ne0 = row length), so an HF (out, in) matrix is stored as [in, out].
  `GGUFReader` exposes each tensor's data in numpy order, (out, in) -- quantised types as (out, bytes per row) --
  and `gguf.quants.dequantize` turns quantised rows back into float32 (out, in). No transpose is ever needed.
- llama.cpp's converter reorders the rows of attn_q and attn_k (weights and biases) inside every head of a
  'llama' file, from HF's rotate-half layout to the interleaved pairs its RoPE kernel expects; `unpermute_rotary`
  undoes that for the rows names.TABLE marks with rotary_heads. 'qwen2' files keep HF's rows (families.py).
- Metadata keys start with the architecture ("llama.block_count", "qwen2.block_count"). Mistral files are 'llama'
  files; a sliding window is applied when the file states {arch}.attention.sliding_window.
- Some facts are not in the metadata but in the tensor list: a file without output.weight ties the output head
  to token_embd, attention/MLP biases exist when their tensors do, and rope_freqs holds per-frequency factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from ..config import ModelConfig, RopeScaling
from ..config_checks import check_values
from ..errors import (
    CheckpointError,
    UnsupportedCheckpointError,
    UnsupportedModelError,
)
from .families import Family, family_of_gguf_arch
from .gguf_blocks import BLOCK_TYPES, dequantize_blocks
from .gguf_file import read_gguf_file
from .names import canonical_name, checkpoint_tensors, gguf_name, layout_flags

# Stored as plain floats: kept in their own dtype (F32 and F16 bit for bit; BF16 reinterpreted).
FLOAT_TYPES: dict[QType, torch.dtype] = {
    QType.F32: torch.float32,
    QType.F16: torch.float16,
    QType.BF16: torch.bfloat16,
}
# Block-quantised types dequantised to float32 (Q4_0, Q4_1 and Q8_0 in torch by gguf_blocks.py, the others with
# gguf.quants): the legacy and k-quant types, the i-quants and ternary types llama.cpp's quantize tool writes for
# LLaMA-family files; each is checked by tests/checkpoints/test_gguf.py. (Q4_0 / Q4_1 may instead be kept as they
# are for int4 kernels: gguf_quant.py.)
QUANTISED_TYPES: frozenset[QType] = frozenset({
    QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
    QType.IQ1_S, QType.IQ1_M, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S,
    QType.IQ4_NL, QType.IQ4_XS, QType.TQ1_0, QType.TQ2_0,
})

ROPE_FREQS = "rope_freqs.weight"
# Metadata keys (after "llama.") that have no default.
_REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (str, int, float, bool, lists)."""
    return read_gguf_file(Path(path)).metadata


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo the row permutation llama.cpp's converter applies to attn_q / attn_k (weight or bias).

    weight: (n_heads * head_dim, ...) as stored in GGUF. Inside each head GGUF keeps the two rows that one rotary
    frequency mixes next to each other; HF's rotate-half layout keeps the first and second halves apart. For one
    head with head_dim 4 and pairs (a_i, b_i):   GGUF rows [a0, b0, a1, b1]  ->  HF rows [a0, a1, b0, b1].
    """
    head_dim = weight.shape[0] // n_heads
    pairs = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])  # (H, D/2, 2, ...)
    return pairs.transpose(1, 2).reshape(weight.shape)  # (H, 2, D/2, ...) flattened back


def to_torch(tensor: gguf.ReaderTensor, path: Path) -> torch.Tensor:
    """A GGUF tensor as a CPU torch tensor in numpy order (out, in): float types as stored, the rest float32."""
    kind = tensor.tensor_type
    if kind in (QType.F32, QType.F16):
        # Copy: the reader's arrays are read-only views of the memory map.
        return torch.from_numpy(np.array(tensor.data))
    if kind == QType.BF16:
        # The reader gives BF16 as raw bytes per row; two bytes are one bfloat16.
        return torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16)
    if kind in BLOCK_TYPES:
        return dequantize_blocks(tensor.data, kind)
    if kind in QUANTISED_TYPES:
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, kind))
    raise _unsupported_type(tensor, path)


def _unsupported_type(tensor: gguf.ReaderTensor, path: Path) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which minilade cannot dequantise "
        f"(supported: {supported_type_names()})"
    )


def supported_type_names() -> str:
    """The GGUF tensor types minilade loads, for messages and --list-models."""
    return ", ".join(t.name for t in sorted({*FLOAT_TYPES, *QUANTISED_TYPES}))


@dataclass(frozen=True)
class GGUFTensors:
    """The LLaMA tensors of one GGUF file under canonical names, read lazily from its memory map."""

    path: Path
    config: ModelConfig  # n_heads / n_kv_heads drive the Q/K un-permutation
    permuted: bool  # attn_q / attn_k rows are in llama.cpp's interleaved rotary order (families.Family.gguf_permuted)
    by_name: dict[str, gguf.ReaderTensor]  # canonical name -> reader tensor
    metadata: dict[str, Any]  # as read_gguf_metadata returns it (the tokenizer can reuse it: parsing is slow)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> HF-orientation shape, from the tensor headers (no data read)."""
        return {name: tuple(int(d) for d in reversed(t.shape)) for name, t in self.by_name.items()}

    def stored_name(self, name: str) -> str:
        return gguf_name(name)

    def load(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time, dequantised and in HF rotary layout."""
        table = checkpoint_tensors(self.config)
        for name in names:
            tensor = to_torch(self.by_name[name], self.path)
            heads = table[name].module.rotary_heads
            if heads is not None and self.permuted:
                tensor = unpermute_rotary(tensor, getattr(self.config, heads))
            yield name, tensor


def open_gguf(path: Path) -> GGUFTensors:
    """Read a LLaMA-family GGUF file's config and tensor index. Raises CheckpointError (UnsupportedCheckpointError
    for an architecture outside families.FAMILIES or a tensor type minilade cannot dequantise)."""
    file = read_gguf_file(path)
    by_name: dict[str, gguf.ReaderTensor] = {}
    for tensor in file.tensors:
        name = canonical_name(tensor.name)
        if name is not None and tensor.tensor_type not in FLOAT_TYPES and tensor.tensor_type not in QUANTISED_TYPES:
            raise _unsupported_type(tensor, path)
        name = name or tensor.name  # kept under its own name: validation rejects tensors the model does not use
        if name in by_name:
            raise CheckpointError(f"{path}: tensors {by_name[name].name} and {tensor.name} are both {name}")
        by_name[name] = tensor
    family = _family(file.metadata, path)
    config = _config(file.metadata, family.gguf_arch, path, by_name)
    return GGUFTensors(path=path, config=config, permuted=family.gguf_permuted, by_name=by_name,
                       metadata=file.metadata)


# ModelConfig field -> the metadata key it is read from (after "llama."), so that a bad value is reported by key.
_GGUF_KEYS = {
    "vocab_size": "vocab_size", "dim": "embedding_length", "n_layers": "block_count",
    "n_heads": "attention.head_count", "n_kv_heads": "attention.head_count_kv",
    "intermediate_size": "feed_forward_length", "head_dim": "attention.key_length",
    "norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base", "max_seq_len": "context_length",
    "sliding_window": "attention.sliding_window",
}


def _config(meta: dict[str, Any], arch: str, path: Path, by_name: dict[str, gguf.ReaderTensor]) -> ModelConfig:
    """ModelConfig from the metadata, plus what only the tensors tell: the canonical names (tied head, biases)
    and llama.cpp's per-frequency rope factors. Raises UnsupportedCheckpointError for a model minilade cannot
    run or a value of the wrong type or range (naming its key), CheckpointError for missing metadata."""
    missing = [f"{arch}.{key}" for key in _REQUIRED_KEYS if f"{arch}.{key}" not in meta]
    if missing:
        raise CheckpointError(f"{path}: GGUF metadata lacks {', '.join(missing)}")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    n_heads = key("attention.head_count")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    tokens = meta.get("tokenizer.ggml.tokens")
    values = dict(
        vocab_size=key("vocab_size") or (len(tokens) if isinstance(tokens, list) else 0),
        dim=key("embedding_length"),
        n_layers=key("block_count"),
        n_heads=n_heads,
        n_kv_heads=key("attention.head_count_kv") or n_heads,
        intermediate_size=key("feed_forward_length"),
        head_dim=key("attention.key_length") or key("rope.dimension_count") or 0,
        norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        max_seq_len=key("context_length", 2048),
        sliding_window=key("attention.sliding_window", 0),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        **layout_flags(by_name.keys()),
    )
    try:
        check_values(values, {field: f"{arch}.{name}" for field, name in _GGUF_KEYS.items()}
                     | {"bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_ids": "tokenizer.ggml.eos_token_id"})
        linear = key("rope.scaling.type") == "linear"
        scaling = RopeScaling("linear", key("rope.scaling.factor", 1.0)) if linear else RopeScaling()
        if values["sliding_window"] >= values["max_seq_len"]:  # a window as long as the context hides nothing
            values["sliding_window"] = 0
        config = ModelConfig(rope_scaling=scaling, **values)
    except UnsupportedModelError as exc:
        raise UnsupportedCheckpointError(f"{path}: {exc}") from exc
    factors = _rope_freq_factors(by_name.get(ROPE_FREQS), path, config.head_dim)
    return config if factors is None else config.replace(rope_freq_factors=factors)


def _family(meta: dict[str, Any], path: Path) -> Family:
    """The family of the file's general.architecture; UnsupportedCheckpointError naming the supported ones."""
    try:
        return family_of_gguf_arch(meta.get("general.architecture"))
    except UnsupportedModelError as exc:
        raise UnsupportedCheckpointError(f"{path}: {exc}") from exc


def _rope_freq_factors(tensor: gguf.ReaderTensor | None, path: Path, head_dim: int) -> tuple[float, ...] | None:
    """llama.cpp's rope_freqs tensor (one divisor per rotary frequency, e.g. Llama 3.1 scaling), if present."""
    if tensor is None:
        return None
    if tensor.n_elements != head_dim // 2:
        raise CheckpointError(f"{path}: {ROPE_FREQS} has {tensor.n_elements} values, expected head_dim/2 = "
                              f"{head_dim // 2}")
    factors = tuple(to_torch(tensor, path).float().flatten().tolist())
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise CheckpointError(f"{path}: {ROPE_FREQS} holds values that are not positive finite numbers")
    return factors
