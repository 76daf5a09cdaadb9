"""Decoding strategies behind one interface.

A strategy (a small frozen settings object, chosen by the user) makes a Decoder for each generation. The decoder
owns the position in the KV cache and emits tokens; the generation loop in loop.py owns everything else
(budget, stop rules, streaming, statistics) and is written once for all strategies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from ..sampling import Sampler


@dataclass
class DecodeContext:
    """The state one generation's decoder works on.

    tokens: the prompt followed by every emitted token. Invariant between steps: cache.length ==
    len(tokens) - 1, i.e. every token except the last has its K/V in the cache; the last is the next input.
    limit: the number of positions the generation may use (the model's context or a smaller budget).
    """

    model: Transformer
    cache: KVCache
    sampler: Sampler
    tokens: list[int]
    limit: int

    @property
    def device(self) -> torch.device:
        return self.model.device


class Decoder(ABC):
    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        self.step_kind = "single"  # what the last step was, in a word (counted in the statistics)
        self.step_tokens = 1       # tokens the last step fed to the model

    def prefill(self) -> list[int]:
        """Run the prompt through the model and emit the first token."""
        ctx = self.ctx
        n = len(ctx.tokens)
        tokens = torch.tensor([ctx.tokens], device=ctx.device)
        rows = torch.tensor([n - 1], device=ctx.device)
        logits = ctx.model(tokens, torch.arange(n, device=ctx.device), ctx.cache, logits_rows=rows)
        ctx.cache.commit(n)
        return self._emit([int(ctx.sampler.pick(logits[0, -1]))])

    @abstractmethod
    def step(self) -> list[int]:
        """One forward pass; returns the tokens it emits (at least one), already appended to ctx.tokens."""

    def _emit(self, block: list[int]) -> list[int]:
        self.ctx.tokens.extend(block)
        return block

    def _single_step(self) -> list[int]:
        """Plain autoregressive step: feed the last token, emit the next one."""
        ctx = self.ctx
        self.step_kind, self.step_tokens = "single", 1
        pos = ctx.cache.length
        tokens = torch.tensor([ctx.tokens[-1:]], device=ctx.device)
        logits = ctx.model(tokens, torch.tensor([pos], device=ctx.device), ctx.cache)
        ctx.cache.commit(1)
        return self._emit([int(ctx.sampler.pick(logits[0, -1]))])


class Strategy(ABC):
    """User-facing settings of a decoding strategy; validated on construction."""

    name: str

    @abstractmethod
    def make_decoder(self, ctx: DecodeContext) -> Decoder: ...

    def max_step_tokens(self) -> int:
        """Most tokens one step puts through the model (the KV cache keeps this much room past the budget)."""
        return 1
