"""Model configuration: one validated dataclass, and named presets.

The checkpoint readers build it from their formats: checkpoints/hf.py from a config.json, checkpoints/gguf.py from
GGUF metadata and tensor list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import UnsupportedModelError


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-frequency scaling. kind: "default", "linear" or "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A LLaMA model's shapes and options. Invariants, checked on construction (UnsupportedModelError otherwise):
    n_heads is a multiple of n_kv_heads (grouped-query attention) and head_dim is even (rotary pairs);
    head_dim 0 means dim // n_heads."""

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
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for rotary embeddings")

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
