"""Model configuration: one dataclass, built from a Hugging Face config.json, from GGUF metadata, or a named preset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import UnsupportedModelError

# model_type values whose checkpoints follow the LLaMA layout exactly (RMSNorm, RoPE, GQA, SwiGLU).
LLAMA_LIKE_MODEL_TYPES = ("llama", "mistral")


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
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from the dict of a Hugging Face config.json (LLaMA-style models only)."""
        model_type = cfg.get("model_type")
        if model_type not in LLAMA_LIKE_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r} (architectures={cfg.get('architectures')}); "
                f"minilade runs LLaMA-style models: {', '.join(LLAMA_LIKE_MODEL_TYPES)}"
            )
        if cfg.get("sliding_window") not in (None, 0) and model_type == "mistral":
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise UnsupportedModelError(f"sliding-window attention ({cfg['sliding_window']}) is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported activation {act!r}; LLaMA-style models use 'silu'")
        n_heads = cfg["num_attention_heads"]
        theta, scaling = _rope_from_hf(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            intermediate_size=cfg["intermediate_size"],
            head_dim=cfg.get("head_dim") or 0,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], tied: bool) -> "ModelConfig":
        """Build from GGUF key/value metadata (plain Python values). tied: the file has no output.weight."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; minilade runs 'llama' GGUF files")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"llama.{name}", default)

        n_heads = key("attention.head_count")
        dim = key("embedding_length")
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = RopeScaling()
        if key("rope.scaling.type") == "linear":
            scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor", 1.0)))
        head_dim = key("attention.key_length") or key("rope.dimension_count") or dim // n_heads
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=vocab,
            dim=dim,
            n_layers=key("block_count"),
            n_heads=n_heads,
            n_kv_heads=key("attention.head_count_kv") or n_heads,
            intermediate_size=key("feed_forward_length"),
            head_dim=head_dim,
            norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=key("context_length", 2048),
            tie_word_embeddings=tied,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
        )

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """Named configurations: tiny ones for tests, and real shapes for benchmarks with random weights."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """Read rope_theta and scaling from either the classic (rope_theta + rope_scaling) or the newer
    rope_parameters form of config.json."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}; minilade supports linear and llama3")


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
