"""Chat templates: the Jinja programs checkpoints ship to turn a list of messages into one prompt string.

Rendering follows Hugging Face transformers' `apply_chat_template` conventions, because that is what template
authors test against: a sandboxed environment (templates come from the internet), `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that does not HTML-escape, the globals
`raise_exception` and `strftime_now`, the `{% generation %}` block (rendered as its body), and the variables
`messages`, `add_generation_prompt`, `tools=None`, `documents=None` plus the special-token strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError, one_line


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes '<', '>' and '&', which would corrupt prompts containing code.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One chat template, compiled on first use (a template that never renders never costs, nor fails, anything)."""

    def __init__(self, source: str) -> None:
        self.source = source

    @cached_property
    def _compiled(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template does not compile: {one_line(error)}") from error

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               special_tokens: Mapping[str, str]) -> str:
        """The prompt text. special_tokens: template variables such as bos_token/eos_token -> their strings."""
        variables = {**special_tokens, "tools": None, "documents": None}
        template = self._compiled
        try:
            return template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.TemplateError, TypeError, ValueError) as error:
            # TypeError/ValueError: the template did arithmetic on a value of the wrong shape, e.g. None + str.
            raise ChatTemplateError(f"chat template failed: {one_line(error)}") from error
