"""minilade/tokenizer/chat_template.py: chat prompts rendered as transformers renders them, the template file
taking precedence, and template failures reported on one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minilade.tokenizer import Tokenizer

from .conftest import CONVERSATIONS, assert_one_line_error


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_chat_matches_transformers(smollm2: Tokenizer, hf_smollm2, messages: list[dict[str, str]]) -> None:
    for prompt in (True, False):
        expected = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert smollm2.render_chat(messages, add_generation_prompt=prompt) == expected
    expected_ids = hf_smollm2.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert smollm2.encode_chat(messages) == expected_ids["input_ids"]


def test_chat_template_file_takes_precedence(spm, tmp_path: Path) -> None:
    folder, _, processor = spm
    (tmp_path / "tokenizer.model").write_bytes((folder / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "ignored"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% generation %}[{{ m.role }}] {{ m.content | tojson }}\n"
        "{% endgeneration %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tokenizer = Tokenizer.from_checkpoint(tmp_path)
    messages = [{"role": "user", "content": "a <b> & c"}]
    rendered = tokenizer.render_chat(messages)
    assert rendered == '<s>[user] "a <b> & c"\n[assistant]'
    # The template writes the BOS; encode_chat adds no second one although encode() adds one by default.
    assert tokenizer.encode_chat(messages) == tokenizer.encode(rendered, add_bos=False)
    assert tokenizer.encode_chat(messages).count(1) == 1 and tokenizer.encode("x") == [1, *processor.encode("x")]


def test_chat_template_errors_are_one_line(spm, tmp_path: Path) -> None:
    folder, _, _ = spm
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.model").write_bytes((folder / "tokenizer.model").read_bytes())
    (tmp_path / "bad" / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message\nmust be from the user') }}{% endif %}"
        "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    )
    bad = Tokenizer.from_checkpoint(tmp_path / "bad")
    assert_one_line_error(lambda: bad.render_chat([{"role": "system", "content": "x"}]), "must be from the user")
    assert_one_line_error(lambda: bad.render_chat([{"role": "user", "content": "x"}]), "chat template failed")
    (tmp_path / "bad" / "chat_template.jinja").write_text("{% for m in messages %}")
    assert_one_line_error(lambda: Tokenizer.from_checkpoint(tmp_path / "bad").render_chat([]), "does not compile")
