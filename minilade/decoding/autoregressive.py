"""Plain autoregressive decoding: one token in, one token out per forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compiled import compiled_step
from .base import DecodeContext, Decoder, Step, Strategy


@dataclass(frozen=True)
class Autoregressive(Strategy):
    """compiled: run each one-token step as one compiled graph (compiled.py): faster, and its tokens are those of
    the stock kernels, not bitwise those the batch-invariant steps of lookahead and auto give."""

    compiled: bool = False
    name = "autoregressive"

    def __post_init__(self) -> None:
        if not isinstance(self.compiled, bool):
            raise ValueError(f"compiled must be True or False, got {self.compiled!r}")

    @property
    def invariant_steps(self) -> bool:
        return not self.compiled

    def make_decoder(self, ctx: DecodeContext) -> Decoder:
        return CompiledDecoder(ctx) if self.compiled else AutoregressiveDecoder(ctx)


class AutoregressiveDecoder(Decoder):
    def step(self) -> Step:
        return self.single_step()


class CompiledDecoder(Decoder):
    """Plain decoding whose steps after the prefill run compiled.one_token_logits, compiled. The prefill runs
    Transformer.forward (causal attention over the prompt, the same in either mode); the cache is unpadded."""

    def __init__(self, ctx: DecodeContext) -> None:
        super().__init__(ctx)
        if ctx.cache.padded:
            raise ValueError("a compiled step needs a cache made with invariant=False")
        self.run = compiled_step(ctx.model)
        for buffer in (ctx.cache.k, ctx.cache.v):
            torch._dynamo.mark_dynamic(buffer, 3)  # the slot count: one graph for every cache capacity

    def step(self) -> Step:
        ctx, model = self.ctx, self.ctx.model
        ctx.cache.check_room(1)
        pos = torch.tensor([ctx.cache.length], device=ctx.device)
        cos, sin = model.rotary(pos.view(1, 1))
        x = model.tok_embeddings(torch.tensor([ctx.tokens[-1:]], device=ctx.device)).to(model.dtype)
        logits = self.run(x, cos, sin, pos, ctx.cache.k, ctx.cache.v)
        ctx.cache.commit(1)
        return Step(self.emit([int(ctx.sampler.pick(ctx.sampler.penalize(logits[0, -1])))]), "single", 1)
