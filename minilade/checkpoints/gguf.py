"""GGUF files (llama.cpp): metadata, tensor names, dequantisation and the Q/K rotary un-permutation.

Facts this module relies on (gguf-py's gguf_reader.py and quants.py, llama.cpp's convert_hf_to_gguf.py):
- GGUF lists dimensions innermost first (ne0 = row length), so an HF (out, in) matrix is stored as [in, out].
  `GGUFReader` exposes each tensor's data in numpy order, (out, in) -- quantised types as (out, bytes per row) --
  and `gguf.quants.dequantize` turns quantised rows back into float32 (out, in). No transpose is ever needed.
- llama.cpp's converter reorders the rows of attn_q and attn_k (weights and biases) inside every head, from HF's
  rotate-half layout to the interleaved pairs its RoPE kernel expects; `unpermute_rotary` undoes that.
- A file without output.weight ties the output head to token_embd.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from ..config import ModelConfig
from ..errors import (
    CheckpointError,
    UnsupportedCheckpointError,
    UnsupportedModelError,
    one_line,
)

# Stored as plain floats: kept in their own dtype (F32 and F16 bit for bit; BF16 reinterpreted).
FLOAT_TYPES: dict[QType, torch.dtype] = {
    QType.F32: torch.float32,
    QType.F16: torch.float16,
    QType.BF16: torch.bfloat16,
}
# Block-quantised types dequantised to float32 with gguf.quants; each is checked by tests/test_weights.py.
QUANTISED_TYPES: frozenset[QType] = frozenset({
    QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
})

# GGUF name -> canonical (Hugging Face) name, for tensors outside the blocks and inside block N ("blk.N.<key>").
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_CANONICAL_BLOCK_NAME = re.compile(r"model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"
# Metadata ModelConfig.from_gguf_metadata cannot default.
_REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (str, int, float, bool, lists)."""
    return _metadata(open_gguf_reader(Path(path)))


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def open_gguf_reader(path: Path) -> gguf.GGUFReader:
    """Open (memory-map) a GGUF file; a truncated or corrupt file raises one CheckpointError."""
    try:
        return gguf.GGUFReader(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or one_line(exc)}") from exc
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        # GGUFReader reads past the end of a short memmap as empty arrays and fails later in numpy:
        # indexing, reshape or enum conversion errors all mean the file is not a complete GGUF file.
        raise CheckpointError(f"{path} is not a valid GGUF file (truncated or corrupt): {one_line(exc)}") from exc


def canonical_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for tensors minilade does not load."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _GGUF_BLOCK_NAME.fullmatch(name)
    if match and match[2] in _BLOCK_NAMES:
        return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"
    return None


def gguf_name(name: str) -> str:
    """The GGUF name of a canonical tensor name (the inverse of canonical_name), for error messages."""
    stem, _, suffix = name.rpartition(".")
    for gguf_stem, hf_stem in _GLOBAL_NAMES.items():
        if stem == hf_stem:
            return f"{gguf_stem}.{suffix}"
    match = _CANONICAL_BLOCK_NAME.fullmatch(name)
    for gguf_key, hf_key in _BLOCK_NAMES.items():
        if match and match[2] == hf_key:
            return f"blk.{match[1]}.{gguf_key}.{match[3]}"
    return name


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
    if kind in QUANTISED_TYPES:
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, kind))
    raise _unsupported_type(tensor, path)


def _unsupported_type(tensor: gguf.ReaderTensor, path: Path) -> UnsupportedCheckpointError:
    supported = ", ".join(sorted(t.name for t in {*FLOAT_TYPES, *QUANTISED_TYPES}))
    return UnsupportedCheckpointError(
        f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which minilade cannot dequantise "
        f"(supported: {supported})"
    )


@dataclass(frozen=True)
class GGUFTensors:
    """The LLaMA tensors of one GGUF file under canonical names, read lazily from its memory map."""

    path: Path
    config: ModelConfig  # n_heads / n_kv_heads drive the Q/K un-permutation
    by_name: dict[str, gguf.ReaderTensor]  # canonical name -> reader tensor
    metadata: dict[str, Any]  # as read_gguf_metadata returns it (the tokenizer can reuse it: parsing is slow)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> HF-orientation shape, from the tensor headers (no data read)."""
        return {name: tuple(int(d) for d in reversed(t.shape)) for name, t in self.by_name.items()}

    def stored_name(self, name: str) -> str:
        return gguf_name(name)

    def load(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time, dequantised and in HF rotary layout."""
        for name in names:
            tensor = to_torch(self.by_name[name], self.path)
            if ".self_attn.q_proj." in name:
                tensor = unpermute_rotary(tensor, self.config.n_heads)
            elif ".self_attn.k_proj." in name:
                tensor = unpermute_rotary(tensor, self.config.n_kv_heads)
            yield name, tensor


def open_gguf(path: Path) -> GGUFTensors:
    """Read a LLaMA GGUF file's config and tensor index. Raises CheckpointError (UnsupportedCheckpointError for a
    non-llama architecture or a tensor type minilade cannot dequantise)."""
    reader = open_gguf_reader(path)
    metadata = _metadata(reader)
    by_name = {hf: t for t in reader.tensors if (hf := canonical_name(t.name)) is not None}
    config = _config(metadata, reader, path, by_name)
    for tensor in by_name.values():
        if tensor.tensor_type not in FLOAT_TYPES and tensor.tensor_type not in QUANTISED_TYPES:
            raise _unsupported_type(tensor, path)
    return GGUFTensors(path=path, config=config, by_name=by_name, metadata=metadata)


def _config(meta: dict[str, Any], reader: gguf.GGUFReader, path: Path, by_name: dict[str, Any]) -> ModelConfig:
    """ModelConfig from the metadata, completed with what only the tensor list tells: tied head, biases, and
    llama.cpp's per-frequency rope factors."""
    arch = meta.get("general.architecture")
    if arch == "llama":
        missing = [f"llama.{key}" for key in _REQUIRED_KEYS if f"llama.{key}" not in meta]
        if missing:
            raise CheckpointError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    try:
        config = ModelConfig.from_gguf_metadata(meta, tied="lm_head.weight" not in by_name)
    except UnsupportedModelError as exc:
        raise UnsupportedCheckpointError(f"{path}: {exc}") from exc
    return config.replace(
        attention_bias="model.layers.0.self_attn.q_proj.bias" in by_name,
        mlp_bias="model.layers.0.mlp.up_proj.bias" in by_name,
        rope_freq_factors=_rope_freq_factors(reader, path, config.head_dim),
    )


def _rope_freq_factors(reader: gguf.GGUFReader, path: Path, head_dim: int) -> tuple[float, ...] | None:
    """llama.cpp's rope_freqs tensor (one divisor per rotary frequency, e.g. Llama 3.1 scaling), if present."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    factors = to_torch(tensor, path).float().flatten().tolist()
    if len(factors) != head_dim // 2:
        raise CheckpointError(f"{path}: {ROPE_FREQS} has {len(factors)} values, expected head_dim/2 = {head_dim // 2}")
    return tuple(factors)
