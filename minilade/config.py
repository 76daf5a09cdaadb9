"""Model configuration: one validated dataclass, and named presets.

The checkpoint readers build it from their formats: checkpoints/hf.py from a config.json, checkpoints/gguf.py from
GGUF metadata and tensor list.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import UnsupportedModelError

# The longest context minilade accepts from a checkpoint: 2^21 positions covers every released LLaMA-style model
# (the longest are 1M-token fine-tunes) while keeping what a header can make the loader allocate bounded
# (rotary tables and a full-context cache grow with it). 2^32-1 or 2^40 in a header is corruption, not a model.
MAX_CONTEXT = 1 << 21
# Inclusive bounds of the integer fields; generous for real models, but finite so that no header value makes
# minilade loop or allocate without bound before the tensor shapes are compared with the file.
_INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24), "dim": (1, 1 << 18), "n_layers": (1, 1 << 10), "n_heads": (1, 1 << 12),
    "n_kv_heads": (1, 1 << 12), "intermediate_size": (1, 1 << 20), "head_dim": (0, 1 << 14),
    "max_seq_len": (1, MAX_CONTEXT), "sliding_window": (0, MAX_CONTEXT),
}
_FLAGS = ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias")


def value_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for the ModelConfig (or RopeScaling) field `name`, or None when it is fine."""
    if name in _INT_BOUNDS:
        low, high = _INT_BOUNDS[name]
        if not _is_int(value):
            return "is not an integer"
        return None if low <= value <= high else f"is outside [{low}, {high}]"
    if name in ("norm_eps", "rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
        return None if _is_positive_number(value) else "is not a positive finite number"
    if name in ("original_max_position_embeddings", "bos_token_id"):
        ok = _is_int(value) and value >= 0 or (value is None and name == "bos_token_id")
        return None if ok else "is not a non-negative integer"
    if name == "eos_token_ids":
        ok = isinstance(value, tuple) and all(_is_int(v) and v >= 0 for v in value)
        return None if ok else "is not a list of non-negative token ids"
    if name == "rope_freq_factors":
        ok = value is None or isinstance(value, tuple) and all(_is_positive_number(v) for v in value)
        return None if ok else "is not a list of positive finite numbers"
    if name in _FLAGS:
        return None if isinstance(value, bool) else "is not true or false"
    return None


def check_values(values: Mapping[str, Any], keys: Mapping[str, str] | None = None) -> None:
    """Raise UnsupportedModelError for the first value of the wrong type or range, naming it by keys[field] (the
    file's own name for it, e.g. "num_attention_heads") or else by the field name."""
    for name, value in values.items():
        problem = value_problem(name, value)
        if problem is not None:
            shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
            raise UnsupportedModelError(f"{(keys or {}).get(name, name)} = {shown} {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


ROPE_KINDS = ("default", "linear", "llama3")  # rotary scalings model.rope_inv_freq computes


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-frequency scaling. kind: one of ROPE_KINDS."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise UnsupportedModelError(f"unsupported rope scaling type {self.kind!r}; minilade supports "
                                        f"{', '.join(ROPE_KINDS)}")
        names = [f.name for f in dataclasses.fields(self) if f.name != "kind"]
        check_values({name: getattr(self, name) for name in names}, {name: f"rope scaling {name}" for name in names})


@dataclass(frozen=True)
class ModelConfig:
    """A LLaMA model's shapes and options. Invariants, checked on construction (UnsupportedModelError otherwise):
    every value has its type and lies in its bounds (value_problem; max_seq_len <= MAX_CONTEXT), n_heads is a
    multiple of n_kv_heads (grouped-query attention) and head_dim is even (rotary pairs); head_dim 0 means
    dim // n_heads. Readers of files call check_values first, so that their errors name the file's key.
    Biases: LLaMA with attention_bias has them on q, k, v and o (qkv_bias and o_bias); Qwen2 on q, k, v only.
    sliding_window: 0 for full attention, else a row at position p sees only keys at positions > p - window
    (Mistral's convention, as transformers': kv > q - window)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Per-frequency divisors stored in some GGUF files (llama.cpp's rope_freqs tensor) instead of rope_scaling.
    rope_freq_factors: tuple[float, ...] | None = None
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_values({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be positive and even for rotary embeddings")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def n_params(self) -> int:
        """Parameter count (embedding and head counted once when tied)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.intermediate_size
        per_layer = attn + mlp + 2 * self.dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + self.dim + head

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """Named configurations: tiny ones for tests, and real shapes for benchmarks with random weights."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


PRESETS: dict[str, ModelConfig] = {
    # Tiny shapes for tests: small vocabularies so that n-grams repeat.
    "tiny-mha": ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_size=64,
                            max_seq_len=256),
    "tiny-gqa": ModelConfig(vocab_size=64, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, intermediate_size=96,
                            max_seq_len=256, tie_word_embeddings=True),
    # Real shapes, for benchmarks and kernel checks with random weights.
    "smollm2-135m": ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                intermediate_size=1536, rope_theta=100000.0, max_seq_len=8192,
                                tie_word_embeddings=True, norm_eps=1e-5),
    "llama-7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            intermediate_size=11008, max_seq_len=4096, norm_eps=1e-5),
}
