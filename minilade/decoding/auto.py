"""Automatic lookahead: pick the shape of every step to maximise expected tokens per second.

Lookahead trades compute per step for fewer steps, which pays only where a step of many tokens costs little
more than a step of one. So the strategy measures that cost on the loaded model (`measure_step_costs`, a few
forward passes, memoised per model and optionally kept in a file) and, step by step, chooses among:
- a plain autoregressive step (1 token in, 1 out);
- a verification step: the input token and g candidates of k tokens from the n-gram pool (1 + g*k tokens in);
- a full lookahead step: the W x (N-1) window plus g candidates, which also feeds the pool from the window.
Expected tokens per step come from running statistics: every verification step reveals, for each candidate, how
many of its tokens matched the model, so one step of g candidates of length k also tells what any g' <= g
candidates of length k' <= k would have accepted. The prompt seeds these statistics (how well its own n-grams
predict it), so the first steps are not blind. When nothing beats one token per cost of one token, the
strategy decodes plainly, so switching it on is safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..ngram_pool import NGramPool
from .base import DecodeContext, Decoder, Step
from .lookahead import Lookahead, LookaheadDecoder, StepShape, Verdict
from .step_costs import StepCosts, step_costs_for

# ---- how many tokens a step will accept ----------------------------------------------------------------------------


class AcceptanceStats:
    """Running mean of candidate tokens accepted per step, for every (g candidates, k tokens each).

    One observation is the list of per-candidate match lengths of a verification step; from it the accepted
    count of any g' <= g, k' <= k follows (the best of the first g' candidates, capped at k'). Older
    observations fade (weight `decay` per step) so the estimate follows the text.
    """

    def __init__(self, guesses: int, cand_len: int, prior: float = 0.3, prior_weight: float = 1.0,
                 decay: float = 0.97) -> None:
        self.G, self.K, self.decay = guesses, cand_len, decay
        self.total = [[prior * prior_weight * min(k, 1) for k in range(cand_len + 1)] for _ in range(guesses + 1)]
        self.weight = [[prior_weight] * (cand_len + 1) for _ in range(guesses + 1)]

    def observe(self, matches: Sequence[int], cand_len: int, weight: float = 1.0) -> None:
        best = 0
        for g, m in enumerate(matches[:self.G], start=1):
            best = max(best, m)
            for k in range(1, cand_len + 1):
                self.total[g][k] = self.decay * self.total[g][k] + weight * min(best, k)
                self.weight[g][k] = self.decay * self.weight[g][k] + weight

    def expected(self, g: int, k: int) -> float:
        return self.total[g][k] / self.weight[g][k] if g and k else 0.0


def prompt_self_prediction(prompt: Sequence[int], ngram: int, guesses: int, last: int = 512) -> list[list[int]]:
    """Per position of the prompt (its last `last` tokens), how many tokens each pool candidate built from the
    text before it would have matched the text that follows: a model-free prior on how repetitive it is."""
    pool = NGramPool(ngram, max(guesses, 1))
    K = ngram - 1
    start = max(0, len(prompt) - last)
    pool.add_ngrams(prompt[:start + 1])
    out = []
    for j in range(start, len(prompt) - 1):
        truth = prompt[j + 1:j + 1 + K]
        matches = []
        for cand in pool.candidates(prompt[j], guesses):
            m = 0
            while m < len(truth) and cand[m] == truth[m]:
                m += 1
            matches.append(m)
        if matches:
            out.append(matches)
        if j + 1 >= ngram - 1:
            pool.add_ngrams(prompt[:j + 2], j + 2 - ngram)
    return out


# ---- the strategy ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Auto(Lookahead):
    """Lookahead with the shape of each step chosen from measured step costs and running acceptance estimates.

    window, ngram, guesses: the largest step it may take (the other settings as for Lookahead).
    cost_file: where measured step costs are kept between runs (None: measured once per process and model).
    costs: step costs to use instead of measuring (benchmarks and tests).
    """

    cost_file: str | None = None
    costs: StepCosts | None = field(default=None, compare=False, repr=False)
    name = "auto"

    def make_decoder(self, ctx: DecodeContext) -> Decoder:
        return AutoDecoder(ctx, self)

    def __str__(self) -> str:
        return f"auto(W<={self.window}, N<={self.ngram}, G<={self.guesses})"


@dataclass(frozen=True)
class Plan:
    shape: StepShape | None  # None: a plain autoregressive step
    n_candidates: int
    cand_len: int
    tokens: int              # fed to the model (at most: candidates sharing a prefix share rows)
    expected: float          # tokens the step is expected to emit


class AutoDecoder(LookaheadDecoder):
    EXPLORE_EVERY = 32  # steps without a verification before a cheap probe (one short candidate)
    DECAY = 0.97  # per step, for the window's running credit

    def __init__(self, ctx: DecodeContext, settings: Auto) -> None:
        super().__init__(ctx, settings)
        layout, K = self.layout, self.layout.levels
        self.verify_shape = StepShape(layout, with_window=False, device=ctx.device)
        sizes = {self.verify_shape.max_rows(g, k) for g in range(1, layout.guesses + 1) for k in range(1, K + 1)}
        sizes |= {self.full_shape.max_rows(g, K) for g in range(layout.guesses + 1)}
        self.costs = settings.costs or step_costs_for(ctx.model, sorted(sizes), settings.cost_file)
        self.acceptance = AcceptanceStats(layout.guesses, K)
        for matches in prompt_self_prediction(ctx.tokens, layout.ngram, layout.guesses):
            self.acceptance.observe(matches, K, weight=0.25)
        # The window's worth: tokens accepted from candidates only the window made, per step that ran it.
        self.window_credit, self.window_steps = 0.5, 1.0  # a prior of half a token per window step
        self.since_verify = 0

    def step(self) -> Step:
        if self.near_end_of_context():
            return self.single_step()
        candidates = self.candidates(self.layout.guesses)
        plan = self.choose(len(candidates))
        self.window_credit *= self.DECAY
        self.window_steps *= self.DECAY
        if plan.shape is None:
            self.since_verify += 1
            return self.single_step()
        self.since_verify = 0
        x = self.ctx.tokens[-1]
        step = self.run_step(plan.shape, candidates[:plan.n_candidates], plan.cand_len)
        self._learn(plan, x, candidates, step.detail)
        return step

    @property
    def window_gain(self) -> float:
        return self.window_credit / self.window_steps

    def options(self, available: int) -> Iterable[Plan]:
        yield Plan(None, 0, 0, 1, 1.0)
        est, verify = self.acceptance.expected, self.verify_shape
        for g in range(1, available + 1):
            for k in range(1, self.layout.levels + 1):
                yield Plan(verify, g, k, verify.max_rows(g, k), 1.0 + est(g, k))
        full, K = self.full_shape, self.layout.levels
        for g in range(available + 1):
            yield Plan(full, g, K, full.max_rows(g, K), 1.0 + est(g, K) + self.window_gain)

    def choose(self, available: int) -> Plan:
        best = max(self.options(available), key=lambda p: p.expected / self.costs(p.tokens))
        if best.shape is None and available and self.since_verify >= self.EXPLORE_EVERY:
            return Plan(self.verify_shape, 1, 1, 2, 1.0 + self.acceptance.expected(1, 1))  # a cheap probe
        return best

    def _learn(self, plan: Plan, x: int, candidates: list[tuple[int, ...]], verdict: Verdict) -> None:
        self.acceptance.observe(verdict.matches, plan.cand_len)
        self.window_steps += plan.shape.with_window
        if verdict.n_accepted and self.pool.from_window(x, candidates[verdict.winner]):
            self.window_credit += verdict.n_accepted
