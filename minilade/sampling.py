"""Turning logits into tokens: penalties for repeating (penalties.py), then greedy choice or sampling with
temperature, top-k and top-p.

The warping lives in one function, `warp`, used by autoregressive decoding and by lookahead verification alike,
so both draw from exactly the same distribution.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .penalties import TokenHistory


def largest(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value over the last dimension, the first of equal ones (a NaN counts as
    largest): torch.argmax(-1). On the CPU in float32 numpy's argmax gives the same index for the same rule in an
    eighth of the time (a row of 49,152 logits: 3.5 against 27 us), and a decoding step takes one per row it reads."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return logits.argmax(-1)
    return torch.as_tensor(np.argmax(logits.numpy(), axis=-1))


# A forward may make each row's greedy choice beside its logits and hand the choices over on the logits tensor it
# returns: the native head does, while the logits are still in the caches of the threads that wrote them (picking
# them afterwards reads every logit back from memory: on a 2-core Zen 3 a one-row step was 0.175 ms faster with the
# head's choices, a drafted step's verification 0.11-0.14 ms). Only that very tensor carries them: an index, a slice
# or a penalized copy of it does not.
_CHOICES = "greedy_choices"


def with_choices(logits: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """logits (..., V) carrying choices (...), which must be largest(logits); returns logits."""
    setattr(logits, _CHOICES, choices)
    return logits


def carried_choices(logits: torch.Tensor) -> torch.Tensor | None:
    """The choices logits carry (with_choices), or None."""
    return getattr(logits, _CHOICES, None)


def greedy_choices(logits: torch.Tensor) -> torch.Tensor:
    """largest(logits) (..., V) -> (...): the choices the logits carry, else computed."""
    choices = carried_choices(logits)
    return largest(logits) if choices is None else choices


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy decoding (top_k and top_p, SAMPLING_ONLY, then stay off). top_k 0 and top_p 1 mean
    off.

    Penalties, applied to the logits before anything else, greedy or sampling (1, 0, 0: off):
    repetition_penalty (Hugging Face): a token already in the prompt or the output has its logit divided by it
    when positive, multiplied when negative. presence_penalty, frequency_penalty (OpenAI, in [-2, 2]): a token's
    logit loses presence_penalty once if it occurs in the output, and frequency_penalty per occurrence.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name in RULES:
            check_field(name, getattr(self, name))
        if self.greedy and (self.top_k or self.top_p < 1.0):
            raise ValueError("top_k and top_p apply only when sampling: set a temperature > 0 (0 means greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


SAMPLING_ONLY = ("top_k", "top_p")  # fields that mean something only when sampling (temperature > 0)
# Each field's rule, alone: what a valid value is, and how the error says it. The rule that ties SAMPLING_ONLY to a
# temperature is SamplingParams' own (a caller may check options one by one before they are merged).
RULES = {
    "repetition_penalty": (lambda v: _number(v) and 0.0 < v < math.inf, "> 0 and finite (1 = off)"),
    "presence_penalty": (lambda v: _number(v) and -2.0 <= v <= 2.0, "in [-2, 2] (0 = off)"),
    "frequency_penalty": (lambda v: _number(v) and -2.0 <= v <= 2.0, "in [-2, 2] (0 = off)"),
    "temperature": (lambda v: _number(v) and 0.0 <= v < math.inf, ">= 0 and finite (0 = greedy)"),  # rejects NaN
    "top_k": (lambda v: _whole(v) and v >= 0, ">= 0, a whole number (0 = off)"),
    "top_p": (lambda v: _number(v) and 0.0 < v <= 1.0, "in (0, 1] (1 = off)"),
    "seed": (lambda v: v is None or (_whole(v) and 0 <= v < 2 ** 64), "in [0, 2**64)"),
}


def check_field(name: str, value: object) -> None:
    """A one-line ValueError unless `value` is valid for the SamplingParams field `name` on its own (RULES)."""
    if name not in RULES:
        raise ValueError(f"{name} is not a sampling setting (one of {', '.join(RULES)})")
    valid, what = RULES[name]
    if not valid(value):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def seeded(params: SamplingParams, agree: Callable[[int], int]) -> SamplingParams:
    """params with a seed: its own, else a fresh one from the OS (as an unseeded torch.Generator seeds itself) passed
    through `agree`, which makes it rank 0's on every rank of a sharded model (DecodeContext.agree; the identity in
    one process), so that every rank draws the same tokens. Greedy settings draw nothing and come back as they are."""
    if params.greedy or params.seed is not None:
        return params
    return dataclasses.replace(params, seed=agree(secrets.randbits(63)))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    return nucleus(probs, params.top_p) if params.top_p < 1.0 else probs


NUCLEUS_FIRST = 256  # how many of the most likely tokens nucleus looks among first


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (..., V) over the tokens top-p keeps, renormalised; 0 elsewhere. In the order of a descending sort, a
    token is dropped where the mass of the tokens before it (mass_before: the sorted probabilities' cumsum less its
    own) reaches top_p; the most likely token, with mass_before 0, is always kept.

    Sorting all V probabilities takes milliseconds (49,152 of them: 4.5 ms on 2 Zen 3 cores, where a decoding step
    takes 8), while the kept tokens are usually a few of the most likely. So the k + 1 most likely are taken first
    (topk, 0.2 ms for 257), and only where the last of them is not yet dropped in some row, more (k eight times
    larger, up to all V). Which tokens are kept is what a whole sort gives: topk's values are the sort's first k + 1
    in the same order, and their cumsum the sort's first k + 1 prefix sums; mass_before never falls along the sorted
    order, so once the (k + 1)-th token is dropped every later one is. The kept probabilities are summed among
    themselves and written into zeros: no other pass over all V. Off the CPU it sorts all V at once: fast there, and
    looking further would read a flag back from the device."""
    V = probs.shape[-1]
    k = NUCLEUS_FIRST if probs.device.type == "cpu" else V
    while True:
        top, order = torch.topk(probs, min(V, k + 1), dim=-1)  # descending
        dropped = top.cumsum(-1) - top >= top_p
        if top.shape[-1] == V or bool(dropped[..., -1].all()):
            kept = top.masked_fill(dropped, 0.0)
            return torch.zeros_like(probs).scatter_(-1, order, kept / kept.sum(-1, keepdim=True))
        k *= 8


class Sampler:
    """Chooses tokens for one generation. All randomness comes from one seeded torch.Generator.
    pick and probs take logits as they are: a decoder penalizes them first (penalize), since only it knows which
    history each row follows."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", prompt: Sequence[int] = (),
                 vocab_size: int = 0) -> None:
        """prompt, vocab_size: the history the penalties start from (needed only when params set one)."""
        self.params = params
        self.history = TokenHistory(params, prompt, vocab_size, device) if params.penalized else None
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens emitted (the penalties' history grows; nothing to do without penalties)."""
        if self.history is not None:
            self.history.add(tokens)

    @property
    def penalizes(self) -> bool:
        """Whether penalties change the logits (penalize is the identity otherwise)."""
        return self.history is not None

    def penalize(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The logits after the penalties (TokenHistory.penalize); the very same tensor when none is set, so
        the plain path does no extra work."""
        return logits if self.history is None else self.history.penalize(logits, drafts)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.params)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of probs (..., V) -> (...), each token with its probability (the rows need not sum to
        1): the first token whose cumulative probability exceeds a uniform draw times the row's total, in float64.
        One uniform a row: torch.multinomial draws a row of 49,152 from as many random numbers, 1.6 ms on 2 Zen 3
        cores. A row that is not a distribution (a NaN or infinity, or nothing but zeros) is a ValueError."""
        flat = probs.reshape(-1, probs.shape[-1]).double()
        cumulative = flat.cumsum(-1)
        total = cumulative[:, -1:]
        if not bool(((total > 0) & (total < math.inf)).all()):
            raise ValueError("cannot sample: the model's probabilities hold a NaN or an infinity, or are all zero")
        u = torch.rand(total.shape, dtype=torch.float64, generator=self.generator, device=probs.device)
        # u * total can round up to total itself: then the last token the cumulative sum rises at
        chosen = torch.minimum(torch.searchsorted(cumulative, u * total, right=True),
                               torch.searchsorted(cumulative, total))
        return chosen.view(probs.shape[:-1])

    def next_token(self, logits: torch.Tensor) -> int:
        """The token after the last row of a forward's logits (1, T, V), as the forward returned them: pick(penalize(
        that row)), the greedy choice read off the logits where the forward made it (with_choices)."""
        chosen = carried_choices(logits)
        if chosen is not None and self.greedy and not self.penalizes:
            return int(chosen[0, -1])
        return int(self.pick(self.penalize(logits[0, -1])))

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token for each row of logits (..., V) -> (...): argmax, or a draw from the warped distribution."""
        if self.greedy:
            return largest(logits)
        return self.draw(self.probs(logits))

    def uniform(self, n: int, device: torch.device | str) -> torch.Tensor:
        """n uniform draws in [0, 1) from this generation's generator (for accept/reject tests)."""
        return torch.rand(n, generator=self.generator, device=device)
