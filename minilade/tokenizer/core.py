"""The Tokenizer: text <-> token ids for one checkpoint, and chat prompts rendered with its template."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ChatTemplateError, TokenizerError
from .chat_template import ChatTemplate
from .detokenize import Detokenizer
from .gguf import is_gguf, read_gguf_tokenizer
from .hf import read_folder_tokenizer
from .parts import Encoder


class Tokenizer:
    """Text <-> ids for one checkpoint; build it with `from_checkpoint`.

    Invariants: every id is in [0, vocab_size); eos_ids is sorted and free of duplicates; encode() adds at most a
    BOS (never an EOS); decode() is a pure function of the ids, which StreamDecoder reproduces incrementally.
    """

    def __init__(self, *, encoder: Encoder, detokenizer: Detokenizer, bos_id: int | None,
                 eos_ids: Iterable[int], add_bos: bool, chat_template: str | None,
                 special_tokens: Mapping[str, str]) -> None:
        """The fields of a TokenizerParts (parts.py says what each means)."""
        if add_bos and bos_id is None:
            raise TokenizerError("the checkpoint asks for a BOS token at the start of every text but declares none")
        self._encoder = encoder
        self.detokenizer = detokenizer  # shared with StreamDecoder, so both decode by the same table
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
        try:
            if path.is_dir():
                return cls(**read_folder_tokenizer(path)._asdict())
            if path.is_file():
                if is_gguf(path):
                    return cls(**read_gguf_tokenizer(path, gguf_metadata)._asdict())
                raise TokenizerError(f"{path} is neither a folder nor a GGUF file")
        except TokenizerError as error:  # every message names the checkpoint it is about
            if str(path) in str(error):
                raise
            raise TokenizerError(f"{path}: {error}") from error
        raise TokenizerError(f"no such file or folder: {path}")

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of text. Special tokens written in it (e.g. "<|im_start|>") become their single ids.
        add_bos: prepend BOS; None follows the checkpoint (self.add_bos)."""
        if not isinstance(text, str):
            raise TokenizerError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: how Python spells bytes that were not valid UTF-8
            raise TokenizerError("the text is not valid UTF-8 (it holds undecodable bytes)") from None
        ids = self._encoder(text)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of ids; skip_special drops control tokens such as BOS/EOS/<|im_start|>."""
        return self.detokenizer.decode(ids, skip_special)

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
