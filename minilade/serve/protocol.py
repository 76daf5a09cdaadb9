"""What a request may ask for, checked field by field before anything runs: the OpenAI fields minilade serves, its
own (top_k, repetition_penalty, the strategy and its settings), and the OpenAI fields it does not serve, refused by
name unless they hold their neutral value (n = 1, no logprobs, no tools, ...). An unknown field is refused too:
nothing a client sends is silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..checkpoints.generation_config import merge_sampling
from ..decoding import STRATEGIES, GenerationSettings, make_strategy
from ..decoding.loop import check_prompt
from ..decoding.step_costs import StepCosts
from ..llm import LLM
from ..sampling import RULES, check_field
from .errors import APIError, invalid

SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
COMMON = {"model", "max_tokens", "stop", "stream", "stream_options", "user", "strategy", *SAMPLING}
# Fields served only at their neutral value, and the values that are neutral.
NEUTRAL_COMMON = {"n": (None, 1), "logprobs": (None, False), "logit_bias": (None, {})}
NEUTRAL_CHAT = {"top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
                "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None,),
                "response_format": (None, {"type": "text"})}
NEUTRAL_COMPLETION = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, "")}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 4
COMPLETION_DEFAULT_TOKENS = 16  # as OpenAI's completions; a chat request's default is the rest of the context


def strategy_options() -> dict[str, tuple[str, ...]]:
    """Each strategy setting a request may give (the fields that are command-line options) -> the strategies that
    have it."""
    owners: dict[str, list[str]] = {}
    for name, kind in STRATEGIES.items():
        for f in dataclasses.fields(kind):
            if "help" in f.metadata:
                owners.setdefault(f.name, []).append(name)
    return {field: tuple(names) for field, names in owners.items()}


STRATEGY_OPTIONS = strategy_options()


@dataclass
class Request:
    """A checked request: its prompt's ids and generation settings, and how to answer it."""

    chat: bool
    prompt_ids: list[int]
    settings: GenerationSettings
    stream: bool
    include_usage: bool


@dataclass
class Served:
    """What the server serves, as the request parser needs it."""

    llm: LLM
    model_id: str
    strategy: str = "auto"
    costs: StepCosts | None = None  # auto's measured step costs, measured once at start


def parse_request(body: Any, chat: bool, served: Served) -> Request:
    """A Request from a decoded JSON body, or an APIError (400; 404 for an unknown model) naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_fields(body, chat)
    model = body.get("model")
    if model is not None and model != served.model_id:
        raise APIError(404, f"model {model!r} is not served here; this server serves {served.model_id!r}",
                       param="model", code="model_not_found")
    prompt_ids = chat_ids(body, served.llm) if chat else completion_ids(body, served.llm)
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options may hold include_usage only", "stream_options")
        include_usage = flag(options, "include_usage", "stream_options.include_usage")
    max_tokens = new_token_budget(body, chat, len(prompt_ids), served.llm.model.config.max_seq_len)
    settings = generation_settings(body, served, max_tokens)
    fit_strategy(settings, len(prompt_ids), served.llm.model.config.max_seq_len)
    return Request(chat, prompt_ids, settings, stream, include_usage)


def check_fields(body: dict, chat: bool) -> None:
    neutral = {**NEUTRAL_COMMON, **(NEUTRAL_CHAT if chat else NEUTRAL_COMPLETION)}
    known = COMMON | set(STRATEGY_OPTIONS) | ({"messages", "max_completion_tokens"} if chat else {"prompt"})
    for name, value in body.items():
        if name in neutral:
            if not is_neutral(value, neutral[name]):
                raise invalid(f"{name} is not supported by this server (only {neutral[name][-1]!r})", name,
                              "unsupported_parameter")
        elif name not in known:
            raise invalid(f"unrecognized request field {name!r}", name, "unrecognized_parameter")
    for required in ("messages",) if chat else ("prompt",):
        if required not in body:
            raise invalid(f"{required} is required", required, "missing_required_parameter")


def is_neutral(value: Any, allowed: tuple) -> bool:
    """None, or one of the allowed values of the very same type (1 is not True)."""
    return value is None or any(type(value) is type(a) and value == a for a in allowed)


def flag(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"{param or name} must be true or false, got {value!r}", param or name)
    return bool(value)


def chat_ids(body: dict, llm: LLM) -> list[int]:
    """The conversation through the checkpoint's chat template, as the CLI's --chat renders it."""
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise invalid(f"{where} must be an object with role and content (and optionally name)", where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        plain.append({"role": ROLES[role], "content": message_text(message.get("content"), f"{where}.content")})
    return encoded(lambda: llm.encode(plain), llm, "messages")


def message_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"{where} must be a string or a list of text parts (this server reads text only)", where)


def completion_ids(body: dict, llm: LLM) -> list[int]:
    """The prompt: a string (tokenized as the CLI does without --chat) or a list of token ids; a list holding one
    of those is that one (a batch of several prompts is refused: n > 1 is not served)."""
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encoded(lambda: llm.encode(prompt), llm, "prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return encoded(lambda: list(prompt), llm, "prompt")
    raise invalid("prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def encoded(encode, llm: LLM, param: str) -> list[int]:
    """encode()'s ids, checked to fit the model (not empty, shorter than the context, in the vocabulary)."""
    try:
        ids = encode()
        check_prompt(ids, llm.model)
    except ValueError as error:
        raise invalid(str(error), param) from None
    return ids


def new_token_budget(body: dict, chat: bool, prompt_len: int, context: int) -> int:
    """max_tokens (or max_completion_tokens), which must fit the context after the prompt."""
    given = {name: body[name] for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None}
    if len(set(given.values())) > 1:
        raise invalid("max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
    room = context - prompt_len
    if not given:
        return room if chat else min(COMPLETION_DEFAULT_TOKENS, room)
    name, value = next(iter(given.items()))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"{name} must be a whole number >= 1, got {value!r}", name)
    if value > room:
        raise invalid(f"the prompt's {prompt_len} tokens and {name} {value} exceed the model's context of {context} "
                      f"tokens; ask for at most {room}", name, "context_length_exceeded")
    return value


def generation_settings(body: dict, served: Served, max_tokens: int) -> GenerationSettings:
    """Sampling (the checkpoint's defaults under what the request gives), stop strings and the strategy."""
    given = {name: body.get(name) for name in SAMPLING}
    for name, value in given.items():
        if value is not None and name in RULES:
            try:
                check_field(name, value)
            except ValueError as error:
                raise invalid(str(error), name) from None
    try:
        sampling = merge_sampling(served.llm.generation_defaults, given)
    except ValueError as error:
        raise invalid(str(error)) from None
    return GenerationSettings(strategy_of(body, served), sampling, max_tokens, stop_strings(body.get("stop")))


def stop_strings(stop: Any) -> tuple[str, ...]:
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOP \
            or not all(isinstance(s, str) and s for s in stops):
        raise invalid(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    return tuple(stops)


def strategy_of(body: dict, served: Served):
    """The strategy the request names (the server's default when none), with the settings it gives; auto takes the
    step costs measured at start."""
    name = body.get("strategy", served.strategy) or served.strategy
    if name not in STRATEGIES:
        raise invalid(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}", "strategy")
    given = {k: body[k] for k in STRATEGY_OPTIONS if body.get(k) is not None}
    for k in given:
        if name not in STRATEGY_OPTIONS[k]:
            raise invalid(f"{k} applies to strategy {' or '.join(STRATEGY_OPTIONS[k])}, not {name}", k)
    try:
        return make_strategy(name, costs=served.costs, **given)
    except (ValueError, TypeError) as error:
        raise invalid(str(error), next(iter(given), "strategy")) from None


def fit_strategy(settings: GenerationSettings, prompt_len: int, context: int) -> None:
    """The strategy's steps must fit the model's context (Strategy.fit), as decode_tokens will check."""
    try:
        settings.strategy.fit(context, max(1, context - prompt_len))
    except ValueError as error:
        raise invalid(str(error), "strategy") from None
