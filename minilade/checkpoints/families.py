"""The model families minilade runs, in one table: how a config.json (model_type) and a GGUF file
(general.architecture) name each, what the family fixes that the LLaMA code leaves optional, and how it is tested.

Every family here is the LLaMA block (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) with options:
biases (Qwen2: on q, k, v only), a sliding attention window (Mistral), a tied or untied head, its rope theta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str  # for people: "Qwen2 / Qwen2.5"
    model_type: str  # config.json's model_type
    gguf_arch: str  # GGUF general.architecture (Mistral files say 'llama'); metadata keys start with it
    # llama.cpp's converter reorders the rows of attn_q / attn_k into interleaved rotary pairs for 'llama' files
    # (its RoPE kernel rotates adjacent pairs there); 'qwen2' files keep HF's rotate-half rows (NEOX rope).
    gguf_permuted: bool
    # Bias flags the family always has (ModelConfig field -> value); None: read from config.json's
    # attention_bias (q, k, v and o together) and mlp_bias.
    fixed_biases: Mapping[str, bool] | None
    tested: str  # what the tests check for this family beyond what they check for every family


# What the tests check for every family is support.TESTED_FOR_EACH.
FAMILIES: tuple[Family, ...] = (
    Family("Llama 1/2/3.x, TinyLlama, SmolLM", "llama", "llama", True, None,
           "Llama 3.1 rope_freqs GGUF; SentencePiece (Llama 2) and llama-bpe (Llama 3) GGUF vocabularies against "
           "sentencepiece/tokenizers; the real SmolLM2-135M Q4_1 GGUF"),
    Family("Mistral (sliding window)", "mistral", "llama", True, None,
           "a window (5) shorter than the text and than a lookahead step; GGUF with llama.attention.sliding_window"),
    Family("Qwen2 / Qwen2.5", "qwen2", "qwen2", False, {"qkv_bias": True, "o_bias": False, "mlp_bias": False},
           "tied and untied head; 'qwen2' GGUF rows left as stored; its vocabulary and ChatML template against "
           "tokenizers/transformers"),
)
MODEL_TYPES = tuple(f.model_type for f in FAMILIES)
GGUF_ARCHS = tuple(dict.fromkeys(f.gguf_arch for f in FAMILIES))


def family_of_model_type(model_type: Any, architectures: Any = None) -> Family:
    """The family of a config.json's model_type; UnsupportedModelError naming it and the supported ones."""
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    raise UnsupportedModelError(
        f"unsupported architecture {model_type!r:.60} (architectures={architectures!r:.80}); "
        f"minilade runs LLaMA-style models: {', '.join(MODEL_TYPES)}")


def family_of_gguf_arch(arch: Any) -> Family:
    """The first family stored under a GGUF architecture ('llama' covers Mistral: the same tensors and keys)."""
    for family in FAMILIES:
        if family.gguf_arch == arch:
            return family
    raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r:.60}; minilade runs "
                                f"{', '.join(repr(a) for a in GGUF_ARCHS)} GGUF files")
