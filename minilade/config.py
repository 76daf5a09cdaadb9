"""Model configuration: one validated dataclass, and named presets.

The checkpoint readers build it from their formats: checkpoints/hf.py from a config.json, checkpoints/gguf.py from
GGUF metadata and tensor list. Every value is checked on construction (config_checks.py), since it may come from
an untrusted file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .config_checks import check_values
from .errors import UnsupportedModelError

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
    every value has its type and lies in its bounds (config_checks.py), n_heads is a multiple of n_kv_heads
    (grouped-query attention) and head_dim is even (rotary pairs); head_dim 0 means dim // n_heads. Readers of
    files call check_values first, so that their errors name the file's key.
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
