"""Text <-> token ids for LLaMA-family checkpoints, with chat templates and streaming detokenisation.

One behaviour, three sources:
  * a Hugging Face folder with `tokenizer.json`        -> encoded by the `tokenizers` library;
  * a folder with only a SentencePiece `tokenizer.model` -> encoded by the `sentencepiece` library;
  * a GGUF file -> a `tokenizers.Tokenizer` rebuilt from the vocabulary in its metadata: byte-level BPE for
    `tokenizer.ggml.model='gpt2'` (SmolLM2, Llama 3), SentencePiece-style BPE with byte fallback for 'llama'
    (Llama 2, TinyLlama).

Encoding is delegated to those libraries (the rebuilt GGUF tokenizers get no decoder). Decoding is done here,
from one table `token id -> bytes`:

    decode(ids) = utf8(b"".join(piece_bytes[i] for i in ids), invalid bytes -> U+FFFD)
                  minus one leading space for SentencePiece vocabularies (the space their encoder prepended)

That is a pure function of one byte string, so `StreamDecoder` reproduces it exactly, piece by piece, with
Python's incremental UTF-8 decoder. On valid UTF-8 it agrees with the libraries' own decoders. On invalid UTF-8
they disagree among themselves about how many U+FFFD to write; here it is one per maximal invalid subsequence
(Unicode's recommended practice, as Python and Rust do, so HF's byte-level decoder agrees exactly), where
`sentencepiece` writes one per invalid byte and `tokenizers`' ByteFallback one per byte token of any run of byte
tokens that is not valid UTF-8 as a whole. Added and special tokens decode to their text verbatim.
"""

from __future__ import annotations

import codecs
import json
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import gguf
import sentencepiece
import tokenizers
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from ..checkpoints.gguf import read_gguf_metadata
from ..checkpoints.hf import read_json_object
from ..errors import ChatTemplateError, TokenizerError, one_line
from .chat_template import ChatTemplate

Encoder = Callable[[str], list[int]]  # text -> ids, special tokens in the text matched, no BOS/EOS added

_SPACE_MARK = "\u2581"  # '▁', SentencePiece's spelling of a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens, e.g. <0x0A>


# --------------------------------------------------------------------------------------------------------------
# Decoding: token id -> bytes
# --------------------------------------------------------------------------------------------------------------

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


def _byte_level_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token stands for. A token with a character outside the alphabet is not
    byte-level-spelled (e.g. a mislabelled added token) and stands for its own UTF-8, as in `tokenizers`."""
    if all(char in _BYTE_OF_CHAR for char in token):
        return bytes(_BYTE_OF_CHAR[char] for char in token)
    return token.encode("utf-8")


def _byte_level_spelling(text: str) -> str:
    """The inverse of _byte_level_bytes: how a byte-level vocabulary spells the UTF-8 of `text`."""
    return "".join(_CHAR_OF_BYTE[b] for b in text.encode("utf-8"))


def _sentencepiece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for: <0xNN> is one raw byte, '▁' is a space."""
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    return piece.replace(_SPACE_MARK, " ").encode("utf-8")


@dataclass(frozen=True)
class _Detokenizer:
    """Token id -> bytes, for every id of the vocabulary.

    Invariant: the text of ids is the UTF-8 decoding (errors -> U+FFFD) of their pieces joined, minus one leading
    space when strip_leading_space; so decoding is local except for multi-byte characters split across tokens."""

    pieces: tuple[bytes, ...]
    special_ids: frozenset[int]
    strip_leading_space: bool

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


# --------------------------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------------------------

class Tokenizer:
    """Text <-> ids for one checkpoint; build it with `from_checkpoint`.

    Invariants: every id is in [0, vocab_size); eos_ids is sorted and free of duplicates; encode() adds at most a
    BOS (never an EOS); decode() is a pure function of the ids, which StreamDecoder reproduces incrementally.
    """

    def __init__(self, *, encoder: Encoder, detokenizer: _Detokenizer, bos_id: int | None,
                 eos_ids: Iterable[int], add_bos: bool, chat_template: str | None,
                 special_tokens: Mapping[str, str]) -> None:
        """special_tokens: the chat-template variables naming special tokens (bos_token, eos_token, ...)."""
        if add_bos and bos_id is None:
            raise TokenizerError("the checkpoint asks for a BOS token at the start of every text but declares none")
        self._encoder = encoder
        self._detokenizer = detokenizer
        self.vocab_size = len(detokenizer.pieces)
        self.bos_id = bos_id
        self.eos_ids = tuple(sorted(set(eos_ids)))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template) if chat_template else None
        self._special_tokens = dict(special_tokens)

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, gguf_metadata: Mapping[str, Any] | None = None) -> Tokenizer:
        """Load from a local folder (tokenizer.json, else tokenizer.model) or a local GGUF file.
        gguf_metadata: the file's metadata when the caller has already read it (parsing it takes seconds)."""
        path = Path(path)
        if path.is_dir():
            return _load_folder(path)
        if path.is_file():
            if _is_gguf(path):
                return _load_gguf(path, gguf_metadata)
            raise TokenizerError(f"{path} is neither a folder nor a GGUF file")
        raise TokenizerError(f"no such file or folder: {path}")

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of text. Special tokens written in it (e.g. "<|im_start|>") become their single ids.
        add_bos: prepend BOS; None follows the checkpoint (self.add_bos)."""
        ids = self._encoder(text)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of ids; skip_special drops control tokens such as BOS/EOS/<|im_start|>."""
        text = self._detokenizer.to_bytes(ids, skip_special).decode("utf-8", errors="replace")
        return self._detokenizer.finish_text(text, at_start=True)

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text the checkpoint's chat template makes of messages ({"role": ..., "content": ...})."""
        if self._template is None:
            raise TokenizerError("this checkpoint has no chat template; encode a plain prompt instead")
        try:
            return self._template.render(
                messages, add_generation_prompt=add_generation_prompt, special_tokens=self._special_tokens
            )
        except ChatTemplateError as error:
            raise TokenizerError(str(error)) from error

    def encode_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """render_chat + encode. No BOS is added beyond what the template writes itself (as HF's
        apply_chat_template), since templates that want a BOS spell it out as {{ bos_token }}."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt), add_bos=False)


class StreamDecoder:
    """Incremental detokenisation for streaming.

    Feed ids as they are generated; the pieces returned by push() and then finish() concatenate to exactly
    tokenizer.decode(all ids). A multi-byte character split across tokens is held back until complete, so no piece
    contains a U+FFFD the full text does not. Each push costs O(its own ids): the only state carried between pushes
    is at most three bytes of an unfinished character and whether any text has been produced yet.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._detokenizer = tokenizer._detokenizer
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


# --------------------------------------------------------------------------------------------------------------
# Hugging Face folders: tokenizer.json or tokenizer.model, plus JSON side files
# --------------------------------------------------------------------------------------------------------------

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _int_list(value: Any) -> list[int]:
    """config.json / generation_config.json token ids: an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


@dataclass(frozen=True)
class _FolderConfig:
    """The side files of a Hugging Face checkpoint folder, each {} or None when absent."""

    tokenizer: dict[str, Any]
    special_tokens_map: dict[str, Any]
    generation: dict[str, Any]
    model: dict[str, Any]
    chat_template: str | None

    @classmethod
    def read(cls, folder: Path) -> _FolderConfig:
        tokenizer = read_json_object(folder / "tokenizer_config.json", optional=True)
        jinja = folder / "chat_template.jinja"
        # As in transformers, a chat_template.jinja file takes precedence over tokenizer_config's template.
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else _config_template(tokenizer)
        side_file = lambda name: read_json_object(folder / name, optional=True)  # noqa: E731
        return cls(tokenizer, side_file("special_tokens_map.json"), side_file("generation_config.json"),
                   side_file("config.json"), template)

    def special_tokens(self) -> dict[str, str]:
        """bos_token/eos_token/unk_token/pad_token -> string, tokenizer_config first, then special_tokens_map."""
        found = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(self.tokenizer.get(name)) or _token_content(self.special_tokens_map.get(name))
            if content:
                found[name] = content
        return found

    def bos_id(self, token_id: Callable[[str], int | None], named: Mapping[str, str]) -> int | None:
        """The id of the named bos_token, else the first bos_token_id of generation_config / config."""
        bos = token_id(named["bos_token"]) if "bos_token" in named else None
        declared = _int_list(self.generation.get("bos_token_id")) or _int_list(self.model.get("bos_token_id"))
        return bos if bos is not None else next(iter(declared), None)

    def eos_ids(self, token_id: Callable[[str], int | None], named: Mapping[str, str]) -> list[int]:
        """Every id declared to end generation: the named eos_token and all of generation_config's and config's."""
        ids = [token_id(named["eos_token"])] if "eos_token" in named else []
        ids += _int_list(self.generation.get("eos_token_id")) + _int_list(self.model.get("eos_token_id"))
        return [i for i in ids if i is not None]


def _config_template(tokenizer_config: dict[str, Any]) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates of which "default" is the one."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _load_folder(folder: Path) -> Tokenizer:
    if (folder / "tokenizer.json").is_file():
        return _load_tokenizer_json(folder)
    if (folder / "tokenizer.model").is_file():
        return _load_sentencepiece_model(folder)
    raise TokenizerError(f"{folder} has neither tokenizer.json nor tokenizer.model")


def _load_tokenizer_json(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # `tokenizers` reports parse errors as plain Exception
        raise TokenizerError(f"{path}: cannot load ({one_line(error)})") from error
    config = _FolderConfig.read(folder)
    named = config.special_tokens()
    bos_id = config.bos_id(backend.token_to_id, named)
    add_bos = config.tokenizer.get("add_bos_token")
    if not isinstance(add_bos, bool):
        # No flag: the post-processor decides, as when transformers encodes with add_special_tokens=True.
        add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
    return Tokenizer(
        encoder=lambda text: backend.encode(text, add_special_tokens=False).ids,
        detokenizer=_tokenizer_json_detokenizer(backend),
        bos_id=bos_id, eos_ids=config.eos_ids(backend.token_to_id, named), add_bos=add_bos,
        chat_template=config.chat_template, special_tokens=named,
    )


def _decoder_parts(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The decoders of a tokenizer.json decoder entry, Sequences flattened."""
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [part for sub in decoder.get("decoders", []) for part in _decoder_parts(sub)]
    return [decoder]


def _strips_leading_space(parts: list[dict[str, Any]]) -> bool:
    for part in parts:
        if part["type"] == "Strip" and part.get("content") == " " and part.get("start", 0) > 0:
            return True
        if part["type"] == "Metaspace":
            return part.get("prepend_scheme", "always") != "never" and part.get("add_prefix_space", True)
    return False


def _tokenizer_json_detokenizer(backend: tokenizers.Tokenizer) -> _Detokenizer:
    """The id -> bytes table of a tokenizer.json, from the kind of its decoder: byte-level (GPT-2, Llama 3,
    SmolLM) or SentencePiece-style (Llama 2, Mistral: '▁' spaces, <0xNN> byte fallback)."""
    parts = _decoder_parts(json.loads(backend.to_str()).get("decoder"))
    kinds = {part["type"] for part in parts}
    spell: Callable[[str], bytes]
    if "ByteLevel" in kinds:
        spell, strip = _byte_level_bytes, False
    elif kinds & {"ByteFallback", "Metaspace", "Replace"}:
        spell, strip = _sentencepiece_bytes, _strips_leading_space(parts)
    else:
        raise TokenizerError(f"unsupported tokenizer.json decoder {sorted(kinds) or None}; "
                             "minilade decodes byte-level and SentencePiece-style vocabularies")
    added = backend.get_added_tokens_decoder()
    size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    pieces = tuple(
        added[i].content.encode("utf-8") if i in added else spell(backend.id_to_token(i) or "") for i in range(size)
    )
    special = frozenset(i for i, token in added.items() if token.special)
    return _Detokenizer(pieces, special, strip)


def _sentencepiece_encoder(processor: sentencepiece.SentencePieceProcessor, matched: Mapping[str, int]) -> Encoder:
    """SentencePiece does not look for control tokens in text, so split on them first (longest first, so a token
    that contains another wins) and let SentencePiece encode each stretch between them. Each stretch gets its
    own dummy-prefix space, as in llama.cpp and HF's legacy Llama tokenizer."""
    if not matched:
        return lambda text: processor.encode(text)
    splitter = re.compile("(" + "|".join(map(re.escape, sorted(matched, key=len, reverse=True))) + ")")

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for n, part in enumerate(splitter.split(text)):  # odd parts are the matched tokens
            if n % 2:
                ids.append(matched[part])
            elif part:
                ids.extend(processor.encode(part))
        return ids

    return encode


def _added_tokens(tokenizer_config: dict[str, Any]) -> dict[int, tuple[str, bool]]:
    """tokenizer_config's added_tokens_decoder: id -> (content, special)."""
    added = {}
    for key, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        content = _token_content(entry)
        if content is not None and str(key).isdigit():
            added[int(key)] = (content, bool(entry.get("special", False)))
    return added


def _sentencepiece_strips_leading_space(processor: sentencepiece.SentencePieceProcessor) -> bool:
    """Whether SentencePiece's decoder drops the '▁' of a first piece (it does when the model adds a dummy
    prefix or removes extra whitespace); probed on the first piece that starts with '▁'."""
    for i in range(processor.get_piece_size()):
        piece = processor.id_to_piece(i)
        if piece.startswith(_SPACE_MARK) and not (processor.is_control(i) or processor.is_unknown(i)):
            return processor.decode([i]) == piece[1:].replace(_SPACE_MARK, " ")
    return False


def _load_sentencepiece_model(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.model"
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as error:
        raise TokenizerError(f"{path}: cannot load ({one_line(error)})") from error
    config = _FolderConfig.read(folder)
    texts = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]  # extended by added tokens
    # Control and unknown pieces (<s>, </s>, <unk>) are special, are matched in text and decode verbatim.
    special = {i for i in range(len(texts)) if processor.is_control(i) or processor.is_unknown(i)}
    verbatim = set(special)
    for added_id, (content, is_special) in _added_tokens(config.tokenizer).items():
        texts.extend([""] * (added_id + 1 - len(texts)))
        texts[added_id] = content
        verbatim.add(added_id)
        special |= {added_id} if is_special else set()
    matched = {texts[i]: i for i in sorted(verbatim) if texts[i]}
    strip = _sentencepiece_strips_leading_space(processor)
    pieces = tuple(t.encode("utf-8") if i in verbatim else _sentencepiece_bytes(t) for i, t in enumerate(texts))
    # The model's own <s>/</s>/<unk>, unless tokenizer_config / special_tokens_map name others.
    own = {"bos_token": processor.bos_id(), "eos_token": processor.eos_id(), "unk_token": processor.unk_id()}
    named = {name: texts[i] for name, i in own.items() if 0 <= i < len(texts)} | config.special_tokens()

    def token_id(text: str) -> int | None:
        piece_id = processor.piece_to_id(text)  # the unknown id for a text that is no piece
        return matched.get(text, piece_id if processor.id_to_piece(piece_id) == text else None)

    bos_id = config.bos_id(token_id, named)
    return Tokenizer(
        encoder=_sentencepiece_encoder(processor, matched),
        detokenizer=_Detokenizer(pieces, frozenset(special), strip),
        bos_id=bos_id, eos_ids=config.eos_ids(token_id, named),
        add_bos=bool(config.tokenizer.get("add_bos_token", bos_id is not None)),  # Llama's default: add BOS
        chat_template=config.chat_template, special_tokens=named,
    )


# --------------------------------------------------------------------------------------------------------------
# GGUF: rebuild the tokenizer from the vocabulary stored in the metadata (llama.cpp's conventions)
# --------------------------------------------------------------------------------------------------------------

_KEY = gguf.Keys.Tokenizer
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
)
_SPECIAL_TYPES = (_CONTROL, _UNKNOWN)  # special: matched in text, skipped by decode(skip_special=True)
_VERBATIM_TYPES = (_CONTROL, _UNKNOWN, _USER_DEFINED)  # matched in text by their text, which they decode to


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


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
        if not len(types) == len(scores) == len(tokens):
            raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(types)} token types and {len(scores)} scores")
        return cls(str(meta.get(_KEY.MODEL)), list(tokens), [int(t) for t in types], list(scores),
                   list(meta.get(_KEY.MERGES) or []))

    def has(self, token_id: Any) -> bool:
        return isinstance(token_id, int) and 0 <= token_id < len(self.tokens)


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


# 'default' is what converters write when they could not identify the tokenizer; it maps to GPT-2's regex here
# (llama.cpp's own 'default' uses an ad-hoc variant). Any other name is refused rather than tokenised wrongly.
_BYTE_LEVEL_SPLITS: Mapping[str, _ByteLevelSplit] = MappingProxyType({
    "gpt-2": _ByteLevelSplit(_gpt2_words, ignore_merges=False, add_bos=False),
    "default": _ByteLevelSplit(_gpt2_words, ignore_merges=False, add_bos=False),
    "smollm": _ByteLevelSplit(_smollm_words, ignore_merges=False, add_bos=False),
    "llama-bpe": _ByteLevelSplit(_llama3_words, ignore_merges=True, add_bos=True),
    "llama3": _ByteLevelSplit(_llama3_words, ignore_merges=True, add_bos=True),
    "llama-v3": _ByteLevelSplit(_llama3_words, ignore_merges=True, add_bos=True),
})


def _byte_level_bpe(vocab: _GgufVocab, pre: str, path: Path) -> tuple[tokenizers.Tokenizer, bool]:
    """(tokenizer, llama.cpp's add_bos default) for tokenizer.ggml.model='gpt2'."""
    split = _BYTE_LEVEL_SPLITS.get(pre)
    if split is None:
        raise TokenizerError(f"{path}: unsupported GGUF pre-tokenizer {pre!r} "
                             f"(minilade knows {', '.join(sorted(_BYTE_LEVEL_SPLITS))})")
    if not vocab.merges:
        raise TokenizerError(f"{path}: byte-level vocabulary without merges ({_KEY.MERGES})")
    # Added tokens keep their text (they are matched in raw text); a normal token stored as plain text rather
    # than in the byte alphabet is respelled so that BPE can reach it.
    token_to_id = {
        token if kind in _VERBATIM_TYPES or all(c in _BYTE_OF_CHAR for c in token) else _byte_level_spelling(token): i
        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
    }
    merges = [(left, right) for left, _, right in (merge.partition(" ") for merge in vocab.merges)]
    try:
        model = models.BPE(token_to_id, merges, ignore_merges=split.ignore_merges)
    except Exception as error:  # `tokenizers` reports a merge of unknown tokens as plain Exception
        raise TokenizerError(f"{path}: inconsistent byte-level vocabulary ({one_line(error)})") from error
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = split.pre_tokenizer()
    return backend, split.add_bos


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


def _sentencepiece_bpe(vocab: _GgufVocab, add_space_prefix: bool) -> tokenizers.Tokenizer:
    """tokenizer.ggml.model='llama': SentencePiece BPE with byte fallback, as `tokenizers` BPE. Spaces become '▁'
    and, with add_space_prefix, every stretch of text between added tokens gets a leading '▁' (llama.cpp does
    the same after each special token). No pre-tokenizer: SentencePiece BPE sees the whole stretch at once."""
    unknown = next((t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == _UNKNOWN), None)
    model = models.BPE({token: i for i, token in enumerate(vocab.tokens)}, _merges_from_scores(vocab),
                       unk_token=unknown, fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    spaces = normalizers.Replace(" ", _SPACE_MARK)
    prefix = [normalizers.Prepend(_SPACE_MARK)] if add_space_prefix else []  # Prepend skips empty stretches
    backend.normalizer = normalizers.Sequence([*prefix, spaces])
    return backend


def _add_matched_tokens(backend: tokenizers.Tokenizer, vocab: _GgufVocab) -> None:
    """Control/unknown tokens become special added tokens and user-defined ones plain added tokens: either way
    `tokenizers` finds them in the raw text, before normalisation, and never cuts them up (as llama.cpp)."""
    def added(kinds: tuple[int, ...], special: bool) -> list[AddedToken]:
        return [AddedToken(token, special=special, normalized=False)
                for token, kind in zip(vocab.tokens, vocab.types, strict=True) if kind in kinds and token]

    backend.add_special_tokens(added(_SPECIAL_TYPES, special=True))
    backend.add_tokens(added((_USER_DEFINED,), special=False))


def _read_gguf(path: Path) -> dict[str, Any]:
    try:
        return read_gguf_metadata(path)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"{path}: unreadable GGUF file ({one_line(error)})") from error


def _load_gguf(path: Path, meta: Mapping[str, Any] | None = None) -> Tokenizer:
    meta = _read_gguf(path) if meta is None else meta
    vocab = _GgufVocab.from_metadata(meta, path)
    spell: Callable[[str], bytes]
    if vocab.model == "gpt2":
        backend, add_bos = _byte_level_bpe(vocab, str(meta.get(_KEY.PRE, "default")), path)
        spell, strip = _byte_level_bytes, False
    elif vocab.model == "llama":
        strip = bool(meta.get(_KEY.ADD_PREFIX, True))
        backend, add_bos, spell = _sentencepiece_bpe(vocab, strip), True, _sentencepiece_bytes
    else:
        raise TokenizerError(f"{path}: unsupported GGUF tokenizer model {vocab.model!r} "
                             "(minilade reads 'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies)")
    _add_matched_tokens(backend, vocab)
    pieces = tuple(token.encode("utf-8") if kind in _VERBATIM_TYPES else spell(token)
                   for token, kind in zip(vocab.tokens, vocab.types, strict=True))
    special = frozenset(i for i, kind in enumerate(vocab.types) if kind in _SPECIAL_TYPES)
    keys = {"bos_token": _KEY.BOS_ID, "eos_token": _KEY.EOS_ID, "unk_token": _KEY.UNK_ID, "pad_token": _KEY.PAD_ID}
    ids: dict[str, Any] = {name: meta.get(key) for name, key in keys.items()}
    bos_id = ids["bos_token"] if vocab.has(ids["bos_token"]) else None
    return Tokenizer(
        encoder=lambda text: backend.encode(text, add_special_tokens=False).ids,
        detokenizer=_Detokenizer(pieces, special, strip),
        bos_id=bos_id,
        eos_ids=[meta[key] for key in (_KEY.EOS_ID, _KEY.EOT_ID, _KEY.EOM_ID) if vocab.has(meta.get(key))],
        add_bos=bool(meta.get(_KEY.ADD_BOS, add_bos and bos_id is not None)),
        chat_template=meta.get(_KEY.CHAT_TEMPLATE),
        special_tokens={name: vocab.tokens[i] for name, i in ids.items() if vocab.has(i)},
    )
