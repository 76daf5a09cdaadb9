"""minilade/tokenizer/hf.py: Hugging Face folders (tokenizer.json written by transformers, a SentencePiece
tokenizer.model, side files) against transformers and `sentencepiece`."""

from __future__ import annotations

import json
from pathlib import Path

from minilade.tokenizer import Tokenizer

from .conftest import CONVERSATIONS, SMOLLM2_TEXTS, assert_one_line_error, spm_texts


def test_tokenizer_json_folder_matches_transformers(hf_smollm2, tmp_path: Path) -> None:
    hf_smollm2.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0, 2]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    folder = Tokenizer.from_checkpoint(tmp_path)
    assert (folder.vocab_size, folder.bos_id, folder.eos_ids, folder.add_bos) == (49152, 1, (0, 2), False)
    for text in SMOLLM2_TEXTS:
        ids = folder.encode(text)
        assert ids == hf_smollm2.encode(text), text
        assert folder.decode(ids) == text
    for messages in CONVERSATIONS:
        assert folder.render_chat(messages) == hf_smollm2.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


def test_sentencepiece_folder_matches_sentencepiece(spm) -> None:
    folder, _, processor = spm
    tokenizer = Tokenizer.from_checkpoint(folder)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_ids, tokenizer.add_bos) == (450, 1, (2,), True)
    for text in spm_texts():
        ids = tokenizer.encode(text, add_bos=False)
        assert ids == processor.encode(text), text
        assert tokenizer.decode(ids) == processor.decode(ids) == text
    assert tokenizer.encode("hello") == [1, *processor.encode("hello")]


def test_sentencepiece_special_tokens_in_text(spm) -> None:
    """Control tokens written in the text are matched; each stretch of text between them gets its own dummy
    prefix (llama.cpp's behaviour), in the folder and the GGUF alike."""
    folder, gguf_path, processor = spm
    expected = [1, 1, *processor.encode("hello"), 2, *processor.encode(" x")]
    for path in (folder, gguf_path):
        assert Tokenizer.from_checkpoint(path).encode("<s>hello</s> x") == expected


def test_sentencepiece_tokenizer_json_folder(spm, tmp_path: Path) -> None:
    """A SentencePiece-style tokenizer.json (Metaspace pre-tokenizer, ByteFallback/Strip decoder), as transformers
    writes it from the same GGUF: same ids as transformers, SentencePiece-style decoding, BOS from the
    post-processor."""
    from transformers import AutoTokenizer

    _, gguf_path, processor = spm
    hf = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf.save_pretrained(tmp_path)
    tokenizer = Tokenizer.from_checkpoint(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_ids, tokenizer.add_bos) == (1, (2,), True)
    for text in spm_texts():
        ids = tokenizer.encode(text)
        assert ids == hf.encode(text), text
        assert tokenizer.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)
        if not text.startswith(" "):  # Metaspace(prepend_scheme='first') adds no '▁' before a leading space
            assert ids[1:] == processor.encode(text)


def test_folder_without_tokenizer_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert_one_line_error(lambda: Tokenizer.from_checkpoint(tmp_path / "empty"), "tokenizer.json", "tokenizer.model")
