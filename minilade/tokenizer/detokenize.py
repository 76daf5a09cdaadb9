"""Token ids -> text: the `token id -> bytes` tables, the decoding rule, and streaming decoding.

Encoding is delegated to the `tokenizers` and `sentencepiece` libraries (the rebuilt GGUF tokenizers get no
decoder). Decoding is done here, from one table `token id -> bytes`:

    decode(ids) = utf8(b"".join(piece_bytes[i] for i in ids), invalid bytes -> U+FFFD)
                  minus one leading space for SentencePiece vocabularies (the space their encoder prepended)

That is a pure function of one byte string, so `StreamDecoder` reproduces it exactly, piece by piece, with
Python's incremental UTF-8 decoder. On valid UTF-8 it agrees with the libraries' own decoders. On invalid UTF-8
they disagree among themselves about how many U+FFFD to write; here it is one per maximal invalid subsequence
(Unicode's recommended practice, as Python and Rust do, so HF's byte-level decoder agrees exactly), where
`sentencepiece` writes one per invalid byte and `tokenizers`' ByteFallback one per byte token of any run of byte
tokens that is not valid UTF-8 as a whole. Added and special tokens decode to their text verbatim.

A vocabulary spells its tokens in one of two ways, each with its `token -> bytes` function here:
  * byte-level (GPT-2, Llama 3, SmolLM2): every byte is one printable character of GPT-2's alphabet;
  * SentencePiece-style (Llama 2, TinyLlama): '▁' is a space, <0xNN> a raw byte (byte fallback).
"""

from __future__ import annotations

import codecs
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..errors import TokenizerError

if TYPE_CHECKING:
    from .core import Tokenizer

SPACE_MARK = "\u2581"  # '▁', SentencePiece's spelling of a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens, e.g. <0x0A>


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level spelling, char -> byte. Printable Latin-1 bytes stand for themselves; the other 68 bytes
    (controls, space, DEL, no-break space, soft hyphen) take the code points from U+0100 on, in byte order, so
    that every token of a byte-level vocabulary is a printable string ('Ġ' = U+0120 is the space)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in set(printable)]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    return {char: byte for byte, char in char_of.items()}


_BYTE_OF_CHAR: Mapping[str, int] = MappingProxyType(_byte_level_alphabet())
_CHAR_OF_BYTE: tuple[str, ...] = tuple(sorted(_BYTE_OF_CHAR, key=_BYTE_OF_CHAR.__getitem__))
_ALPHABET = frozenset(_BYTE_OF_CHAR)
# Each alphabet character to the character of its byte's code point, so that str.translate then Latin-1 gives the
# bytes in C loops (a vocabulary has ~10^5 tokens, spelled once per load).
_LATIN1_OF_CHAR = str.maketrans({char: chr(byte) for char, byte in _BYTE_OF_CHAR.items()})


def is_byte_level_spelled(token: str) -> bool:
    """Whether every character of token is in GPT-2's byte alphabet."""
    return _ALPHABET.issuperset(token)


def byte_level_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token stands for. A token with a character outside the alphabet is not
    byte-level-spelled (e.g. a mislabelled added token) and stands for its own UTF-8, as in `tokenizers`."""
    if _ALPHABET.issuperset(token):
        return token.translate(_LATIN1_OF_CHAR).encode("latin-1")
    return token.encode("utf-8")


def byte_level_spelling(text: str) -> str:
    """The inverse of byte_level_bytes: how a byte-level vocabulary spells the UTF-8 of `text`."""
    return "".join(_CHAR_OF_BYTE[b] for b in text.encode("utf-8"))


def sentencepiece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for: <0xNN> is one raw byte, '▁' is a space."""
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    return piece.replace(SPACE_MARK, " ").encode("utf-8")


@dataclass(frozen=True)
class Detokenizer:
    """Token id -> bytes, for every id of the vocabulary.

    Invariant: the text of ids is the UTF-8 decoding (errors -> U+FFFD) of their pieces joined, minus one leading
    space when strip_leading_space; so decoding is local except for multi-byte characters split across tokens."""

    pieces: tuple[bytes, ...]
    special_ids: frozenset[int]
    strip_leading_space: bool

    def decode(self, ids: Iterable[int], skip_special: bool) -> str:
        """The text of ids, in one piece (the rule of the module docstring)."""
        text = self.to_bytes(ids, skip_special).decode("utf-8", errors="replace")
        return self.finish_text(text, at_start=True)

    def to_bytes(self, ids: Iterable[int], skip_special: bool) -> bytes:
        out = []
        for token_id in map(operator.index, ids):  # index(): numpy/torch integers work, floats are rejected
            if not 0 <= token_id < len(self.pieces):
                raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {len(self.pieces)})")
            if not (skip_special and token_id in self.special_ids):
                out.append(self.pieces[token_id])
        return b"".join(out)

    def finish_text(self, text: str, at_start: bool) -> str:
        """Drop the encoder's leading space from the first text of a sequence."""
        if at_start and self.strip_leading_space and text.startswith(" "):
            return text[1:]
        return text


class StreamDecoder:
    """Incremental detokenisation for streaming.

    Feed ids as they are generated; the pieces returned by push() and then finish() concatenate to exactly
    tokenizer.decode(all ids). A multi-byte character split across tokens is held back until complete, so no piece
    contains a U+FFFD the full text does not. Each push costs O(its own ids): the only state carried between pushes
    is at most three bytes of an unfinished character and whether any text has been produced yet.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._detokenizer = tokenizer.detokenizer
        self._skip_special = skip_special
        # Same error policy as bytes.decode(errors="replace"), so incremental and one-shot decoding agree.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True  # no text yet: a SentencePiece leading space may still have to be dropped

    def push(self, ids: Iterable[int]) -> str:
        """Text completed by these ids (possibly empty)."""
        return self._emit(self._utf8.decode(self._detokenizer.to_bytes(ids, self._skip_special)))

    def finish(self) -> str:
        """Whatever is still held back: an unfinished byte sequence at the very end becomes U+FFFD, as in decode()."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        # The start is over once any text was decoded, even a lone space that finish_text() then drops.
        at_start, self._at_start = self._at_start, self._at_start and not text
        return self._detokenizer.finish_text(text, at_start)
