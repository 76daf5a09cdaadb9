"""Turning logits into tokens: greedy choice, and sampling with temperature, top-k and top-p.

The warping lives in one function, `warp`, used by autoregressive decoding and by lookahead verification alike,
so both draw from exactly the same distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy decoding (top_k and top_p are then ignored). top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.temperature == 0.0 and (self.top_k or self.top_p < 1.0):
            raise ValueError("top_k and top_p apply only when sampling: set a temperature > 0 (0 means greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (..., V), float32, after temperature, then top-k, then top-p (the order Hugging Face uses).

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one token). The logits
    are shifted by their maximum before the division, so a tiny temperature cannot overflow to inf - inf.
    """
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token always has mass_before 0
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Sampler:
    """Chooses tokens for one generation. All randomness comes from one seeded torch.Generator."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.params)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of probs (..., V) -> (...)."""
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).view(probs.shape[:-1])

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token for each row of logits (..., V) -> (...): argmax, or a draw from the warped distribution."""
        if self.greedy:
            return logits.argmax(-1)
        return self.draw(self.probs(logits))

    def uniform(self, n: int, device: torch.device | str) -> torch.Tensor:
        """n uniform draws in [0, 1) from this generation's generator (for accept/reject tests)."""
        return torch.rand(n, generator=self.generator, device=device)
