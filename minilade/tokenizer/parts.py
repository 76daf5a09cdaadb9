"""What a tokenizer source (hf.py: a Hugging Face folder; gguf.py: a GGUF file) hands to `Tokenizer` (core.py).

The sources know file formats and nothing of the Tokenizer class; the Tokenizer knows nothing of file formats.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import tokenizers

from .detokenize import Detokenizer

Encoder = Callable[[str], list[int]]  # text -> ids, special tokens in the text matched, no BOS/EOS added


class TokenizerParts(NamedTuple):
    """The keyword arguments of Tokenizer(...), as one source read them from its files."""

    encoder: Encoder
    detokenizer: Detokenizer
    bos_id: int | None
    eos_ids: Iterable[int]
    add_bos: bool  # the checkpoint's default: prepend bos_id to every encoded text
    chat_template: str | None
    special_tokens: Mapping[str, str]  # chat-template variables naming special tokens (bos_token, eos_token, ...)


def library_encoder(backend: tokenizers.Tokenizer) -> Encoder:
    """Encode with a `tokenizers` backend; its post-processor (which may add BOS/EOS) is not applied."""
    return lambda text: backend.encode(text, add_special_tokens=False).ids
