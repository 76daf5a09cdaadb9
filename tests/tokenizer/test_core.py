"""minilade/tokenizer/core.py: from_checkpoint's choice of source and the Tokenizer's own one-line errors."""

from __future__ import annotations

from pathlib import Path

from minilade.tokenizer import Tokenizer

from .conftest import assert_one_line_error


def test_from_checkpoint_errors_are_one_line(tmp_path: Path) -> None:
    assert_one_line_error(lambda: Tokenizer.from_checkpoint(tmp_path / "missing"), "no such file or folder")
    (tmp_path / "notes.txt").write_text("hello")
    assert_one_line_error(lambda: Tokenizer.from_checkpoint(tmp_path / "notes.txt"), "neither a folder nor a GGUF")


def test_render_chat_without_template_is_a_one_line_error(spm) -> None:
    _, gguf_path, _ = spm
    chatless = Tokenizer.from_checkpoint(gguf_path)
    assert_one_line_error(lambda: chatless.render_chat([{"role": "user", "content": "hi"}]), "no chat template")
