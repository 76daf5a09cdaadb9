"""GGUF files: a `tokenizers.Tokenizer` rebuilt from the vocabulary in the metadata, by llama.cpp's conventions.

  * `tokenizer.ggml.model='gpt2'` (SmolLM2, Llama 3, Qwen2): byte-level BPE from the stored merges, with the
    pre-tokenizer that `tokenizer.ggml.pre` names (how text is cut into words before BPE);
  * 'llama' (Llama 2, TinyLlama): SentencePiece-style BPE with byte fallback, its merges rebuilt from the scores.

Control and unknown tokens are special (matched in text, skipped by decode(skip_special=True)); user-defined ones
are matched in text too. The rebuilt tokenizers only encode; detokenize.py decodes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from ..checkpoints.gguf import read_gguf_metadata
from ..errors import TokenizerError, one_line
from .detokenize import (
    SPACE_MARK,
    Detokenizer,
    byte_level_bytes,
    byte_level_spelling,
    is_byte_level_spelled,
    sentencepiece_bytes,
)
from .parts import Encoder, TokenizerParts, library_encoder

_KEY = gguf.Keys.Tokenizer
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
)
_SPECIAL_TYPES = (_CONTROL, _UNKNOWN)  # special: matched in text, skipped by decode(skip_special=True)
_VERBATIM_TYPES = (_CONTROL, _UNKNOWN, _USER_DEFINED)  # matched in text by their text, which they decode to


def is_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic bytes."""
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf_tokenizer(path: Path, meta: Mapping[str, Any] | None = None) -> TokenizerParts:
    """The tokenizer of a GGUF file. meta: its metadata when the caller has already read it."""
    meta = _read_gguf(path) if meta is None else meta
    vocab = _GgufVocab.from_metadata(meta, path)
    spell: Callable[[str], bytes]
    if vocab.model == "gpt2":
        backend, add_bos = _byte_level_bpe(vocab, str(meta.get(_KEY.PRE, "default")), path)
        _add_matched_tokens(backend, vocab)
        encoder, spell, strip = library_encoder(backend), byte_level_bytes, False
    elif vocab.model == "llama":
        strip = bool(meta.get(_KEY.ADD_PREFIX, True))
        encoder, add_bos, spell = _sentencepiece_encoder(vocab, strip), True, sentencepiece_bytes
    else:
        raise TokenizerError(f"{path}: unsupported GGUF tokenizer model {vocab.model!r} "
                             "(minilade reads 'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies)")
    pieces = tuple(token.encode("utf-8") if kind in _VERBATIM_TYPES else spell(token)
                   for token, kind in zip(vocab.tokens, vocab.types, strict=True))
    special = frozenset(i for i, kind in enumerate(vocab.types) if kind in _SPECIAL_TYPES)
    keys = {"bos_token": _KEY.BOS_ID, "eos_token": _KEY.EOS_ID, "unk_token": _KEY.UNK_ID, "pad_token": _KEY.PAD_ID}
    ids: dict[str, Any] = {name: meta.get(key) for name, key in keys.items()}
    bos_id = ids["bos_token"] if vocab.has(ids["bos_token"]) else None
    return TokenizerParts(
        encoder=encoder,
        detokenizer=Detokenizer(pieces, special, strip),
        bos_id=bos_id,
        eos_ids=[meta[key] for key in (_KEY.EOS_ID, _KEY.EOT_ID, _KEY.EOM_ID) if vocab.has(meta.get(key))],
        add_bos=bool(meta.get(_KEY.ADD_BOS, add_bos and bos_id is not None)),
        chat_template=meta.get(_KEY.CHAT_TEMPLATE),
        special_tokens={name: vocab.tokens[i] for name, i in ids.items() if vocab.has(i)},
    )


def _read_gguf(path: Path) -> dict[str, Any]:
    try:
        return read_gguf_metadata(path)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"{path}: unreadable GGUF file ({one_line(error)})") from error


@dataclass(frozen=True)
class _GgufVocab:
    """The tokenizer.ggml.* arrays, validated to one entry per token."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], path: Path) -> _GgufVocab:
        tokens = meta.get(_KEY.LIST)
        if not tokens:
            raise TokenizerError(f"{path} has no tokenizer vocabulary ({_KEY.LIST})")
        types = meta.get(_KEY.TOKEN_TYPE) or [_NORMAL] * len(tokens)
        scores = meta.get(_KEY.SCORES) or [0.0] * len(tokens)
        merges = meta.get(_KEY.MERGES) or []
        for key, value, kinds, what in ((_KEY.LIST, tokens, str, "strings"), (_KEY.TOKEN_TYPE, types, int, "integers"),
                                        (_KEY.SCORES, scores, (int, float), "numbers"),
                                        (_KEY.MERGES, merges, str, "strings")):
            if not isinstance(value, list) or not all(isinstance(v, kinds) for v in value):
                raise TokenizerError(f"{path}: {key} is not a list of {what}")
        if not len(types) == len(scores) == len(tokens):
            raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(types)} token types and {len(scores)} scores")
        return cls(str(meta.get(_KEY.MODEL)), list(tokens), [int(t) for t in types], list(scores), list(merges))

    def has(self, token_id: Any) -> bool:
        return isinstance(token_id, int) and 0 <= token_id < len(self.tokens)


def _add_matched_tokens(backend: tokenizers.Tokenizer, vocab: _GgufVocab) -> None:
    """Control/unknown tokens become special added tokens and user-defined ones plain added tokens: either way
    `tokenizers` finds them in the raw text, before normalisation, and never cuts them up (as llama.cpp)."""
    backend.add_special_tokens(_added(vocab, _SPECIAL_TYPES, special=True))
    backend.add_tokens(_added(vocab, (_USER_DEFINED,), special=False))


def _added(vocab: _GgufVocab, kinds: tuple[int, ...], special: bool) -> list[AddedToken]:
    return [AddedToken(token, special=special, normalized=False)
            for token, kind in zip(vocab.tokens, vocab.types, strict=True) if kind in kinds and token]


# --------------------------------------------------------------------------------------------------------------
# 'gpt2': byte-level BPE and its pre-tokenizers
# --------------------------------------------------------------------------------------------------------------

class _ByteLevelSplit(NamedTuple):
    """How one `tokenizer.ggml.pre` cuts text into words before byte-level BPE, plus llama.cpp's defaults for it."""

    pre_tokenizer: Callable[[], pre_tokenizers.PreTokenizer]
    ignore_merges: bool  # a word that is itself a token is taken whole, without replaying merges
    add_bos: bool  # when the file has no tokenizer.ggml.add_bos_token


# Llama 3's split regex, from its tokenizer.json: like GPT-4's, numbers in groups of at most three digits.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# Qwen2's, from its tokenizer.json (llama.cpp's 'qwen2'): Llama 3's, but every digit is its own word.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2_words() -> pre_tokenizers.PreTokenizer:
    # ByteLevel with use_regex applies GPT-2's split regex, then spells each word in the byte alphabet.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_words() -> pre_tokenizers.PreTokenizer:
    # SmolLM's tokenizer.json (and llama.cpp's 'smollm', a '\p{N}' split first): every digit is its own word.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_words()])


def _llama3_words() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _qwen2_words() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# 'default' is what converters write when they could not identify the tokenizer; it maps to GPT-2's regex here
# (llama.cpp's own 'default' uses an ad-hoc variant). Any other name is refused rather than tokenised wrongly.
_BYTE_LEVEL_SPLITS: Mapping[str, _ByteLevelSplit] = MappingProxyType({
    "gpt-2": _ByteLevelSplit(_gpt2_words, ignore_merges=False, add_bos=False),
    "default": _ByteLevelSplit(_gpt2_words, ignore_merges=False, add_bos=False),
    "smollm": _ByteLevelSplit(_smollm_words, ignore_merges=False, add_bos=False),
    "llama-bpe": _ByteLevelSplit(_llama3_words, ignore_merges=True, add_bos=True),
    "llama3": _ByteLevelSplit(_llama3_words, ignore_merges=True, add_bos=True),
    "llama-v3": _ByteLevelSplit(_llama3_words, ignore_merges=True, add_bos=True),
    "qwen2": _ByteLevelSplit(_qwen2_words, ignore_merges=False, add_bos=False),
})
PRE_TOKENIZERS = tuple(sorted(_BYTE_LEVEL_SPLITS))  # the tokenizer.ggml.pre values minilade reads
# Pre-tokenizers whose tokenizer.json normalises text to NFC first (Qwen2's does; the model never saw other forms).
_NFC_FIRST = frozenset({"qwen2"})


def _byte_level_bpe(vocab: _GgufVocab, pre: str, path: Path) -> tuple[tokenizers.Tokenizer, bool]:
    """(tokenizer, llama.cpp's add_bos default) for tokenizer.ggml.model='gpt2'."""
    split = _BYTE_LEVEL_SPLITS.get(pre)
    if split is None:
        raise TokenizerError(f"{path}: unsupported GGUF pre-tokenizer {pre!r} "
                             f"(minilade knows {', '.join(PRE_TOKENIZERS)})")
    if not vocab.merges:
        raise TokenizerError(f"{path}: byte-level vocabulary without merges ({_KEY.MERGES})")
    # Added tokens keep their text (they are matched in raw text); a normal token stored as plain text rather
    # than in the byte alphabet is respelled so that BPE can reach it.
    token_to_id = {
        token if kind in _VERBATIM_TYPES or is_byte_level_spelled(token) else byte_level_spelling(token): i
        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
    }
    merges = [(left, right) for left, _, right in (merge.partition(" ") for merge in vocab.merges)]
    try:
        model = models.BPE(token_to_id, merges, ignore_merges=split.ignore_merges)
    except Exception as error:  # `tokenizers` reports a merge of unknown tokens as plain Exception
        raise TokenizerError(f"{path}: inconsistent byte-level vocabulary ({one_line(error)})") from error
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = split.pre_tokenizer()
    if pre in _NFC_FIRST:
        backend.normalizer = normalizers.NFC()
    return backend, split.add_bos


# --------------------------------------------------------------------------------------------------------------
# 'llama': SentencePiece-style BPE with byte fallback
# --------------------------------------------------------------------------------------------------------------

def _merges_from_scores(vocab: _GgufVocab) -> list[tuple[str, str]]:
    """SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the best-scoring piece;
    `tokenizers` BPE joins the pair with the best merge rank. So every cut of a normal piece into two normal
    pieces becomes a merge, ranked by the whole piece's score (ties: lower id first, as SentencePiece lists
    its pieces best first)."""
    kinds = zip(vocab.tokens, vocab.types, strict=True)
    normal = {token: i for i, (token, kind) in enumerate(kinds) if kind == _NORMAL}
    ranked = []
    for piece, piece_id in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-vocab.scores[piece_id], piece_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_encoder(vocab: _GgufVocab, add_space_prefix: bool) -> Encoder:
    """tokenizer.ggml.model='llama': SentencePiece BPE with byte fallback, as `tokenizers` BPE. Spaces become '▁'.
    Control tokens written in the text are cut out first, and with add_space_prefix every stretch between them
    gets a leading space (llama.cpp does the same: sentencepiece itself never matches control tokens in text).
    User-defined tokens are matched inside a stretch after its prefix, as sentencepiece matches them
    ("<tool>the" is '▁' '<tool>' 'the', "a<tool>b" is '▁a' '<tool>' 'b'). No pre-tokenizer: SentencePiece BPE
    sees the whole stretch at once."""
    unknown = next((t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == _UNKNOWN), None)
    model = models.BPE({token: i for i, token in enumerate(vocab.tokens)}, _merges_from_scores(vocab),
                       unk_token=unknown, fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
    backend.add_tokens(_added(vocab, (_USER_DEFINED,), special=False))
    controls = {token: i for i, token in reversed(list(enumerate(vocab.tokens)))  # the first id of a repeated one
                if vocab.types[i] in _SPECIAL_TYPES and token}
    # Longest first, so that at each place the longest control token wins, as `tokenizers` matches added tokens.
    longest_first = sorted(controls, key=len, reverse=True)
    cut = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if controls else None
    prefix = " " if add_space_prefix else ""

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for n, part in enumerate(cut.split(text) if cut else [text]):
            if n % 2:  # a control token
                ids.append(controls[part])
            elif part:
                ids += backend.encode(prefix + part, add_special_tokens=False).ids
        return ids

    return encode
