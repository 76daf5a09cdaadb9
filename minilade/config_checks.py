"""The type and range of every ModelConfig value, checked before a model is built from a file's header.

A checkpoint's header is untrusted input: a wrong type or an absurd size must be one clear error naming the file's
key, never a crash or an unbounded allocation later on.
"""

from __future__ import annotations

import math
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
