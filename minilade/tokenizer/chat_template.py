"""Chat templates: the Jinja programs checkpoints ship to turn a list of messages into one prompt string.

Rendering follows Hugging Face transformers' `apply_chat_template` conventions, because that is what template
authors test against: a sandboxed environment (templates come from the internet), `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that does not HTML-escape, the globals
`raise_exception` and `strftime_now`, the `{% generation %}` block (rendered as its body), and the variables
`messages`, `add_generation_prompt`, `tools=None`, `documents=None` plus the special-token strings.

Templates come from files anyone can publish, so rendering is bounded as well as sandboxed: every loop item,
call, filter and growing operator is a step of a render budget (RENDER_SECONDS of wall time); a `*`, `**`, `+`
or `~` whose result would exceed MAX_CHARS items is refused before it is computed, so are call and filter
arguments above MAX_CHARS, and the output may not exceed MAX_CHARS characters. Anything a template does past these
bounds (or a MemoryError / RecursionError on the way) is one ChatTemplateError.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError, one_line

# Wall-time budget of one render; real templates take milliseconds, even for long conversations.
RENDER_SECONDS = 5.0
# Largest string or sequence a template may build, and largest output: far beyond any model's context.
MAX_CHARS = 1 << 24
_SIZED = (str, list, tuple)


class _OverBudget(Exception):
    """A template went past a rendering bound; render() reports it as a ChatTemplateError."""


class _Budget:
    """The deadline of the render in progress (held in _CURRENT, so one compiled template serves every render)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def step(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"rendering took longer than {RENDER_SECONDS:g} s")


_CURRENT: ContextVar[_Budget] = ContextVar("chat_template_budget")


def _step() -> None:
    budget = _CURRENT.get(None)
    if budget is not None:
        budget.step()


def _check_size(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise _OverBudget(f"{what} of {size} items would exceed the limit of {MAX_CHARS}")


def _check_arguments(args: Iterable[Any]) -> None:
    """Refuse integer arguments that could only serve to allocate: widths, counts and repeats past MAX_CHARS."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_CHARS:
            raise _OverBudget(f"argument {arg} exceeds the limit of {MAX_CHARS}")


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    """Every for-loop's iterable is wrapped in this (see _bounded_tree): each item is a budget step, so nested
    loops over range(100000) stop at the deadline instead of running for minutes."""
    for item in iterable:
        _step()
        yield item


def _concat(*values: Any) -> str:
    """The `~` operator (jinja2.nodes.Concat), refused before joining when the result would exceed MAX_CHARS."""
    _step()
    texts = [str(v) for v in values]
    _check_size(sum(map(len, texts)), "a concatenation")
    return "".join(texts)


def _bounded_tree(tree: jinja2.nodes.Template) -> jinja2.nodes.Template:
    """The parsed template with every for-loop's iterable wrapped in _counted and every `~` replaced by
    _concat, so that loops and concatenations are charged to the budget."""
    for loop in tree.find_all(jinja2.nodes.For):
        loop.iter = jinja2.nodes.Call(jinja2.nodes.Name("_counted", "load"), [loop.iter], [], None, None)
    for concat in list(tree.find_all(jinja2.nodes.Concat)):
        # A Concat node cannot become a Call in place (its parent holds it), so it keeps its class and gets
        # the call as its only operand: Concat of one string is that string.
        concat.nodes = [jinja2.nodes.Call(jinja2.nodes.Name("_concat", "load"), concat.nodes, [], None, None)]
    return tree


def _bounded_filter(function: Any) -> Any:
    @functools.wraps(function)  # keeps jinja_pass_arg, so context-taking filters still get their context
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _step()
        _check_arguments([*args, *kwargs.values()])
        return function(*args, **kwargs)
    return bounded


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with calls, filters and the growing operators charged to the render budget."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 -- as jinja2
        _step()
        _check_arguments([*args, *kwargs.values()])
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, _SIZED):
            _check_size(len(result), "a value")
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _step()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, _SIZED) and isinstance(times, int):
                    _check_size(len(seq) * max(times, 0), "a repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            _check_size(abs(left).bit_length() * right, "a power (in bits)")
        elif operator == "+" and isinstance(left, _SIZED) and isinstance(right, _SIZED):
            _check_size(len(left) + len(right), "a concatenation")
        return super().call_binop(context, operator, left, right)


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
        env = _BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
        env.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs in one uncounted call
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, _counted=_counted,
                           _concat=_concat)
        try:
            return env.from_string(_bounded_tree(env.parse(self.source)))
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template does not compile: {one_line(error)}") from error

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               special_tokens: Mapping[str, str]) -> str:
        """The prompt text. special_tokens: template variables such as bos_token/eos_token -> their strings.
        Raises ChatTemplateError (one line) when the template fails or goes past a rendering bound."""
        variables = {**special_tokens, "tools": None, "documents": None}
        template = self._compiled
        token = _CURRENT.set(_Budget(RENDER_SECONDS))
        try:
            chunks = template.generate(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
            )
            return _joined(chunks)
        except _OverBudget as error:
            raise ChatTemplateError(f"chat template stopped: {error}") from None
        except (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError) as error:
            # TypeError/ValueError: the template did arithmetic on a value of the wrong shape, e.g. None + str;
            # OverflowError: range() past the sandbox's limit.
            raise ChatTemplateError(f"chat template failed: {one_line(error)}") from error
        except (MemoryError, RecursionError) as error:
            raise ChatTemplateError(f"chat template failed: {type(error).__name__} while rendering") from None
        finally:
            _CURRENT.reset(token)


def _joined(chunks: Iterable[str]) -> str:
    """The output, refused as soon as it grows past MAX_CHARS."""
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        _check_size(size, "the output")
        parts.append(chunk)
    return "".join(parts)
