"""minilade/tokenizer/chat_template.py: chat prompts rendered as transformers renders them, the template file
taking precedence, and template failures reported on one line."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from minilade.errors import ChatTemplateError
from minilade.tokenizer import Tokenizer, chat_template
from minilade.tokenizer.chat_template import ChatTemplate

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


# ---------------------------------------------------------------------------------------------------------------
# Hostile templates: rendering is bounded in time and size
# ---------------------------------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]


def render(source: str) -> str:
    return ChatTemplate(source).render(MESSAGES, add_generation_prompt=True, special_tokens={"bos_token": "<s>"})


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% for i in range(1000) %}{{ n }}{% endfor %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
], ids=["nested-empty-loops", "nested-loops", "recursive-macro"])
def test_rendering_stops_at_the_time_budget(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nested range(100000) loops used to render for minutes."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    monkeypatch.setattr(chat_template, "MAX_CHARS", 1 << 30)  # so the time bound, not the size bound, stops it
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError) as info:
        render(source)
    assert time.perf_counter() - start < 3.0
    assert "\n" not in str(info.value)
    assert "rendering took longer than 0.3 s" in str(info.value) or "RecursionError" in str(info.value)


@pytest.mark.parametrize("source, fragment", [
    ("{{ 'a' * 20000000000 }}", "a repetition of 20000000000 items would exceed"),
    ("{{ 20000000000 * 'a' }}", "a repetition of 20000000000 items would exceed"),
    ("{{ [0] * 20000000000 }}", "a repetition of 20000000000 items"),
    ("{{ 7 ** 10000000000 }}", "a power (in bits)"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a concatenation of 33554432 items"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a concatenation of 33554432 items"),
    ("{{ 'x'.ljust(10 ** 10) }}", "argument 10000000000 exceeds"),
    ("{{ 'x' | center(10 ** 10) }}", "argument 10000000000 exceeds"),
    ("{% for i in range(20) %}{{ 'a' * 1000000 }}{% endfor %}", "the output of 17000000 items"),
    ("{{ range(10 ** 6) | list }}", "Range too big"),
], ids=["str-repeat", "repeat-str", "list-repeat", "power", "tilde-doubling", "plus-doubling", "method-width",
        "filter-width", "output", "range"])
def test_rendering_refuses_huge_values_before_building_them(source: str, fragment: str) -> None:
    """{{ 'a' * 20000000000 }} used to raise MemoryError (or allocate 20 GB)."""
    with pytest.raises(ChatTemplateError, match=re.escape(fragment)) as info:
        render(source)
    assert "\n" not in str(info.value)


def test_bounded_sandbox_renders_real_template_features() -> None:
    """Loops (with loop.* and else), `~`, filters with context, macros and namespaces still work."""
    source = ("{% set ns = namespace(n=0) %}{% macro tag(m) %}<{{ m.role | upper }}>{% endmacro %}"
              "{% for m in messages if m.role %}{{ loop.index }}/{{ loop.length }}{{ tag(m) ~ m.content }}"
              "{% set ns.n = ns.n + 1 %}{% else %}none{% endfor %}{{ ns.n }}{{ messages | map(attribute='role')"
              " | join(',') }}{{ bos_token * 2 }}")
    assert render(source) == "1/1<USER>hi1user<s><s>"
    assert render("{% for m in [] %}x{% else %}empty{% endfor %}") == "empty"
