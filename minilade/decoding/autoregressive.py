"""Plain autoregressive decoding: one token in, one token out per forward pass."""

from __future__ import annotations

from dataclasses import dataclass

from .base import DecodeContext, Decoder, Step, Strategy


@dataclass(frozen=True)
class Autoregressive(Strategy):
    """One token per forward pass."""

    name = "autoregressive"

    def make_decoder(self, ctx: DecodeContext) -> Decoder:
        return AutoregressiveDecoder(ctx)


class AutoregressiveDecoder(Decoder):
    def step(self) -> Step:
        return self.single_step()
