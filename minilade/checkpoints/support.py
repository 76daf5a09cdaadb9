"""What minilade runs, as `python -m minilade.generate --list-models` prints it: every fact read from where it is
decided (the family table, the rotary scalings the model computes, the GGUF tensor types and vocabularies the
loaders read), so the listing cannot drift from the code."""

from __future__ import annotations

from ..config import ROPE_KINDS
from ..tokenizer.gguf import PRE_TOKENIZERS
from .families import FAMILIES
from .gguf import supported_type_names

TESTED_FOR_EACH = ("against transformers' own class for the family: float64 logits of a prefill and of every row "
                   "of a lookahead step, greedy lookahead == autoregressive, GGUF files F32, F16, BF16, Q8_0, Q5_x, "
                   "Q4_x (tests/checkpoints/test_families.py)")


def describe_support() -> str:
    """A few lines for people: families (with how each is tested), then the options and file contents read."""
    width = max(len(f.name) for f in FAMILIES)
    lines = ["Model families (config.json model_type / GGUF general.architecture), each tested " + TESTED_FOR_EACH]
    for family in FAMILIES:
        lines.append(f"  {family.name:<{width}}  {family.model_type} / {family.gguf_arch}")
        lines.append(f"  {'':<{width}}  also tested: {family.tested}")
    lines += [
        "Attention: grouped-query; biases on q/k/v, o and MLP as the family has them; one sliding window for "
        "every layer (Mistral; Qwen2 when every layer uses it)",
        f"Rotary scaling: {', '.join(ROPE_KINDS)}; GGUF rope_freqs factors (Llama 3.1+)",
        f"GGUF tensor types: {supported_type_names()}",
        f"GGUF vocabularies: 'llama' (SentencePiece BPE, byte fallback), 'gpt2' (byte-level BPE) with "
        f"tokenizer.ggml.pre {', '.join(PRE_TOKENIZERS)}",
        "Safetensors folders: float weights (F16, BF16, F32, F64); quantised HF checkpoints are refused",
        "Anything else is refused before any weight is read: one line naming it and what is supported, exit 2.",
    ]
    return "\n".join(lines)
