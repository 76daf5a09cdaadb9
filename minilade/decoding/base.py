"""Decoding strategies behind one interface.

A Strategy is a small frozen settings object chosen by the user; it makes a Decoder for each generation. The
decoder owns the position in the KV cache and emits tokens, one forward pass per call, and returns a Step that
says what the pass did. The generation loop (loop.py) owns everything else -- budget, stop rules, streaming,
statistics -- and is written once for all strategies; it learns about a step only from the Step it is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from ..kv_cache import KVCache
from ..model import PREFILL_ROWS, Transformer
from ..sampling import Sampler

T = TypeVar("T")


class Agree(Protocol):
    """Rank 0's value of what it is given (any picklable value), on every rank of a sharded model."""

    def __call__(self, value: T) -> T: ...


def single_process(value: T) -> T:
    """Agree in a single process: every value is already rank 0's."""
    return value


@dataclass
class DecodeContext:
    """The state one generation's decoder works on.

    tokens: the prompt followed by every emitted token. Invariant between steps: cache.length ==
    len(tokens) - 1, i.e. every token except the last has its K/V in the cache; the last is the next input.
    limit: the number of positions the generation may use (the model's context or a smaller budget).
    agree: rank 0's value of what it is given; the identity in one process. Every rank of a sharded model reads the
    same logits, so whatever is decided from them is decided alike; a decision that does not come from them (a
    sampling seed, measured step costs) goes through agree.
    """

    model: Transformer
    cache: KVCache
    sampler: Sampler
    tokens: list[int]
    limit: int
    agree: Agree = single_process

    @property
    def device(self) -> torch.device:
        return self.model.device


@dataclass(frozen=True)
class StepKind:
    """The shape of a step: whether it ran the lookahead window, and how many draft paths (of up to `depth`
    tokens) it verified. StepKind() is a plain one-token step."""

    window: bool = False
    paths: int = 0
    depth: int = 0

    @property
    def plain(self) -> bool:
        return not self.window and not self.paths

    def __str__(self) -> str:
        if self.plain:
            return "single"
        return f"{'window+' if self.window else 'verify '}{self.paths}x{self.depth}"


@dataclass(frozen=True)
class Step:
    """What one forward pass of a decoder did.

    tokens: the tokens it emits (at least one), already appended to the context's tokens.
    kind: its shape, counted in the statistics. fed: rows put through the model.
    detail: whatever else the decoder wants to keep about it (for lookahead, the Verdict); the loop ignores it.
    drafts_fed: rows fed beyond x, by the source that proposed them ("window" for the lookahead window's rows);
    drafts_accepted: tokens emitted beyond the one every step gives, by source.
    """

    tokens: list[int]
    kind: StepKind
    fed: int
    detail: Any = None
    drafts_fed: Counter = field(default_factory=Counter)
    drafts_accepted: Counter = field(default_factory=Counter)


class Decoder(ABC):
    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx

    def prefill(self) -> Step:
        """Run the prompt through the model and emit the first token. The prompt's first cache.length tokens
        already have their K/V in the cache (a prefix kept from an earlier generation: LLM); the rest is read in
        parts of PREFILL_ROWS rows after them (the scores a part's attention holds stay those of one block), each
        with the bits a whole prefill gives it (the exact kernel: text_stream.splits_exactly)."""
        ctx = self.ctx
        n, past = len(ctx.tokens), ctx.cache.length
        part = PREFILL_ROWS if past else n
        tokens = torch.tensor([ctx.tokens], device=ctx.device)
        for a in range(past, n, part):
            b = min(a + part, n)
            rows = torch.tensor([b - a - 1], device=ctx.device)
            logits = ctx.model(tokens[:, a:b], torch.arange(a, b, device=ctx.device), ctx.cache, logits_rows=rows,
                               prefill=True)
            ctx.cache.commit(b - a)
        return Step(self.emit([ctx.sampler.next_token(logits)]), StepKind(), n - past)

    @abstractmethod
    def step(self) -> Step:
        """One forward pass after the prefill."""

    def finish(self, handed_out: int) -> None:
        """The generation is over (finished, or its consumer stopped): nothing more will run. The consumer got
        the first `handed_out` tokens after the prompt in ctx.tokens (a step may have emitted a few more)."""

    def emit(self, block: list[int]) -> list[int]:
        self.ctx.tokens.extend(block)
        self.ctx.sampler.observe(block)
        return block

    def single_step(self) -> Step:
        """Plain autoregressive step: feed the last token, emit the next one."""
        ctx = self.ctx
        pos = ctx.cache.length
        tokens = torch.tensor([ctx.tokens[-1:]], device=ctx.device)
        logits = ctx.model(tokens, torch.tensor([pos], device=ctx.device), ctx.cache)
        ctx.cache.commit(1)
        return Step(self.emit([ctx.sampler.next_token(logits)]), StepKind(), 1)


class Strategy(ABC):
    """User-facing settings of a decoding strategy; validated on construction."""

    name: str

    @abstractmethod
    def make_decoder(self, ctx: DecodeContext) -> Decoder: ...

    def cache_type(self, model: Transformer) -> type[KVCache]:
        """The kind of KV cache the decoder works on: the one the model's forwards read, as model.new_cache
        makes it; a strategy that runs steps of its own names the one they read."""
        return model.cache_type

    def max_step_tokens(self) -> int:
        """Most tokens one step puts through the model (the KV cache keeps this much room past the budget)."""
        return 1

    def fit(self, context: int, room: int) -> "Strategy":
        """This strategy, or a copy of it whose steps fit a generation with `room` of the model's `context`
        positions left after the prompt. By default a step larger than the whole context is refused in one line
        (near the context's end a decoder takes smaller steps itself); Auto shrinks its steps instead."""
        step = self.max_step_tokens()
        if step > context:
            raise ValueError(f"one step of {self} feeds up to {step} tokens, more than the model's whole context "
                             f"of {context}; choose a smaller window (-W), n-gram size (-N) or number of guesses "
                             f"(-G), or strategy auto, which fits its steps to the context")
        return self


def whole_number(value: object, what: str, minimum: int) -> None:
    """A one-line ValueError unless value is an int (not a bool) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be a whole number >= {minimum}, got {value!r}")


def option(help: str, *flags: str, metavar: str | None = None) -> dict[str, Any]:
    """Metadata that makes a settings dataclass's field a command-line option (cli.py): its help, its flags
    (default --field-name) and metavar. The field's default is the option's default; a bool field is a switch that
    sets the opposite of its default."""
    return {"help": help, "flags": flags, "metavar": metavar}
