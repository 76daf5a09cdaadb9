"""Hugging Face checkpoint folders: `tokenizer.json`, else a SentencePiece `tokenizer.model`, plus side files.

  * tokenizer.json is encoded by the `tokenizers` library; its decoder entry says how the vocabulary is spelled
    (byte-level or SentencePiece-style), from which detokenize.py's table is built;
  * a folder with only tokenizer.model is encoded by the `sentencepiece` library, which does not match special
    tokens in text, so they are split off first;
  * the JSON side files (tokenizer_config.json, special_tokens_map.json, generation_config.json, config.json) and
    chat_template.jinja name the special tokens, the BOS/EOS ids, whether to add BOS, and the chat template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import sentencepiece
import tokenizers

from ..checkpoints.hf import read_json_object
from ..errors import TokenizerError, one_line
from .detokenize import SPACE_MARK, Detokenizer, byte_level_bytes, sentencepiece_bytes
from .parts import Encoder, TokenizerParts, library_encoder

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_SIDE_FILES = MappingProxyType({  # _FolderConfig field -> the JSON file it is read from
    "tokenizer": "tokenizer_config.json",
    "special_tokens_map": "special_tokens_map.json",
    "generation": "generation_config.json",
    "model": "config.json",
})


def read_folder_tokenizer(folder: Path) -> TokenizerParts:
    """The tokenizer of a checkpoint folder: tokenizer.json if there is one, else tokenizer.model."""
    if (folder / "tokenizer.json").is_file():
        return _read_tokenizer_json(folder)
    if (folder / "tokenizer.model").is_file():
        return _read_sentencepiece_model(folder)
    raise TokenizerError(f"{folder} has neither tokenizer.json nor tokenizer.model")


# --------------------------------------------------------------------------------------------------------------
# Side files
# --------------------------------------------------------------------------------------------------------------

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
    """The side files of a Hugging Face checkpoint folder: each JSON file {} when absent, chat_template None."""

    tokenizer: dict[str, Any]
    special_tokens_map: dict[str, Any]
    generation: dict[str, Any]
    model: dict[str, Any]
    chat_template: str | None

    @classmethod
    def read(cls, folder: Path) -> _FolderConfig:
        files = {field: read_json_object(folder / name, optional=True) for field, name in _SIDE_FILES.items()}
        return cls(**files, chat_template=_read_chat_template(folder, files["tokenizer"]))

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


def _read_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """As in transformers, a chat_template.jinja file takes precedence over tokenizer_config's template."""
    jinja = folder / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else _config_template(tokenizer_config)


def _config_template(tokenizer_config: dict[str, Any]) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates of which "default" is the one."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


# --------------------------------------------------------------------------------------------------------------
# tokenizer.json
# --------------------------------------------------------------------------------------------------------------

def _read_tokenizer_json(folder: Path) -> TokenizerParts:
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
    return TokenizerParts(
        encoder=library_encoder(backend),
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
    """Whether a SentencePiece-style decoder drops the space its pre-tokenizer put before the first word."""
    for part in parts:
        if part["type"] == "Strip" and part.get("content") == " " and part.get("start", 0) > 0:
            return True
        if part["type"] == "Metaspace":
            return part.get("prepend_scheme", "always") != "never" and part.get("add_prefix_space", True)
    return False


def _tokenizer_json_detokenizer(backend: tokenizers.Tokenizer) -> Detokenizer:
    """The id -> bytes table of a tokenizer.json, from the kind of its decoder: byte-level (GPT-2, Llama 3,
    SmolLM) or SentencePiece-style (Llama 2, Mistral: '▁' spaces, <0xNN> byte fallback)."""
    parts = _decoder_parts(json.loads(backend.to_str()).get("decoder"))
    kinds = {part["type"] for part in parts}
    spell: Callable[[str], bytes]
    if "ByteLevel" in kinds:
        spell, strip = byte_level_bytes, False
    elif kinds & {"ByteFallback", "Metaspace", "Replace"}:
        spell, strip = sentencepiece_bytes, _strips_leading_space(parts)
    else:
        raise TokenizerError(f"unsupported tokenizer.json decoder {sorted(kinds) or None}; "
                             "minilade decodes byte-level and SentencePiece-style vocabularies")
    added = backend.get_added_tokens_decoder()
    size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    pieces = tuple(
        added[i].content.encode("utf-8") if i in added else spell(backend.id_to_token(i) or "") for i in range(size)
    )
    special = frozenset(i for i, token in added.items() if token.special)
    return Detokenizer(pieces, special, strip)


# --------------------------------------------------------------------------------------------------------------
# tokenizer.model (SentencePiece)
# --------------------------------------------------------------------------------------------------------------

def _read_sentencepiece_model(folder: Path) -> TokenizerParts:
    processor = _open_sentencepiece(folder / "tokenizer.model")
    config = _FolderConfig.read(folder)
    texts, special, verbatim = _sentencepiece_pieces(processor, _added_tokens(config.tokenizer))
    matched = {texts[i]: i for i in sorted(verbatim) if texts[i]}
    pieces = tuple(t.encode("utf-8") if i in verbatim else sentencepiece_bytes(t) for i, t in enumerate(texts))
    # The model's own <s>/</s>/<unk>, unless tokenizer_config / special_tokens_map name others.
    own = {"bos_token": processor.bos_id(), "eos_token": processor.eos_id(), "unk_token": processor.unk_id()}
    named = {name: texts[i] for name, i in own.items() if 0 <= i < len(texts)} | config.special_tokens()

    def token_id(text: str) -> int | None:
        piece_id = processor.piece_to_id(text)  # the unknown id for a text that is no piece
        return matched.get(text, piece_id if processor.id_to_piece(piece_id) == text else None)

    bos_id = config.bos_id(token_id, named)
    return TokenizerParts(
        encoder=_sentencepiece_encoder(processor, matched),
        detokenizer=Detokenizer(pieces, frozenset(special), _sentencepiece_strips_leading_space(processor)),
        bos_id=bos_id, eos_ids=config.eos_ids(token_id, named),
        add_bos=bool(config.tokenizer.get("add_bos_token", bos_id is not None)),  # Llama's default: add BOS
        chat_template=config.chat_template, special_tokens=named,
    )


def _open_sentencepiece(path: Path) -> sentencepiece.SentencePieceProcessor:
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as error:
        raise TokenizerError(f"{path}: cannot load ({one_line(error)})") from error


def _added_tokens(tokenizer_config: dict[str, Any]) -> dict[int, tuple[str, bool]]:
    """tokenizer_config's added_tokens_decoder: id -> (content, special)."""
    added = {}
    for key, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        content = _token_content(entry)
        if content is not None and str(key).isdigit():
            added[int(key)] = (content, bool(entry.get("special", False)))
    return added


def _sentencepiece_pieces(processor: sentencepiece.SentencePieceProcessor,
                          added: Mapping[int, tuple[str, bool]]) -> tuple[list[str], set[int], set[int]]:
    """(text of every id, special ids, verbatim ids): the model's pieces extended (or overwritten) by the added
    tokens. Verbatim tokens are matched in text and decode to their text; special ones (a subset) are also
    skipped by decode(skip_special=True)."""
    texts = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    # Control and unknown pieces (<s>, </s>, <unk>) are special, are matched in text and decode verbatim.
    special = {i for i in range(len(texts)) if processor.is_control(i) or processor.is_unknown(i)}
    verbatim = set(special)
    for added_id, (content, is_special) in added.items():
        texts.extend([""] * (added_id + 1 - len(texts)))
        texts[added_id] = content
        verbatim.add(added_id)
        special |= {added_id} if is_special else set()
    return texts, special, verbatim


def _sentencepiece_strips_leading_space(processor: sentencepiece.SentencePieceProcessor) -> bool:
    """Whether SentencePiece's decoder drops the '▁' of a first piece (it does when the model adds a dummy
    prefix or removes extra whitespace); probed on the first piece that starts with '▁'."""
    for i in range(processor.get_piece_size()):
        piece = processor.id_to_piece(i)
        if piece.startswith(SPACE_MARK) and not (processor.is_control(i) or processor.is_unknown(i)):
            return processor.decode([i]) == piece[1:].replace(SPACE_MARK, " ")
    return False


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
