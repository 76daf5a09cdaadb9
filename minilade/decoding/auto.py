"""Automatic lookahead: one scored draft tree per step, fed as far as it pays in expected tokens per second.

Lookahead trades compute per step for fewer steps, which pays only where a step of many tokens costs little
more than a step of one. So the strategy measures that cost on the loaded model (`measure_step_costs`, a few
forward passes, memoised per model and optionally kept in a file) and, every step:
1. gathers draft paths from its sources (minilade/drafts/): suffix drafts of any length from the text and, when
   given a DraftHistory, from the model's answers to earlier prompts; the n-gram pool's candidates (from the text
   and from the lookahead window); when on, a tree recycled from the model's own top-k outputs; all merged into
   one trie (DraftTree);
2. scores every node with its chance of being accepted, the product of its path's calibrated conditional chances
   (Calibration, learnt online from every verification and seeded by replaying the prompt);
3. feeds x and the b most likely nodes (ancestors first; the expected number of accepted tokens is the sum of
   their chances), with or without the W x (N-1) window, choosing b and the window to maximise expected tokens
   per second under the measured cost curve and the draft budget. b = 0 without the window is a plain step, so
   switching the strategy on is safe where nothing pays.
It is built from the paper's pieces (lookahead.py: the Jacobi window, the pool, the packed step with its
verification) and the draft sources. The window's worth is the tokens later accepted from n-grams only it
produced, per step that ran it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..drafts.history import DraftHistory
from ..drafts.recycle import RecycleTable
from ..drafts.sources import (
    DraftSource,
    HistoryDrafts,
    PoolDrafts,
    RecycledDrafts,
    SuffixDrafts,
    replay_calibration,
    text_sources,
)
from ..drafts.suffix import SuffixIndex
from ..drafts.tree import Calibration, DraftPath, DraftTree, Key
from ..masks import CandidateTree, StepShape
from ..model import Transformer
from ..verify import Verdict
from .base import Agree, DecodeContext, Decoder, Step, StepKind, Strategy, option, single_process, whole_number
from .lookahead import JacobiWindow, WindowAndPool, packed_step, text_pool, window_fits
from .step_costs import StepCosts, step_costs_for

COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # step sizes measured for the cost curve
# Conditional chances of a draft token being right, by source, before any evidence.
PRIORS = {"suffix": 0.5, "history": 0.3, "pool": 0.2, "window": 0.15, "recycle": 0.15}
PROMPT_REPLAY = 384  # prompt positions replayed to seed the calibration
RECYCLE_WIDTHS = (None, 2, 1, 1)  # children per node at each depth of the recycled tree (None: all k)


class SharedPasses(Protocol):
    """The forward passes a generation shares with others (a server's engine): what they feed, and what it will."""

    def others(self, costs: StepCosts) -> tuple[Callable[[int], float], float, float]:
        """The next pass as the other generations feed it: its seconds as a function of the rows this generation
        feeds (one generation's step alone costing `costs`), the tokens the others' rows are expected to emit, and
        the pass's tokens per second were every generation in it to feed one row."""

    def plan(self, rows: int, expected: float) -> None:
        """This generation's next step feeds `rows` rows and is expected to emit `expected` tokens."""

    def generations(self) -> int:
        """How many generations share the passes, this one included."""


@dataclass(frozen=True)
class Auto(WindowAndPool, Strategy):
    """Lookahead with every step shaped from measured step costs and calibrated draft chances.

    window, ngram, guesses, pool_from_prompt, pool_capacity, seed: the window and pool it may use (WindowAndPool).
    suffix_draft: the longest suffix draft (0: none); suffix_branches: at most this many a step.
    recycle_topk: keep the model's top-k next tokens after every token it reads (a (V, k) table) and draft a tree
    from it (0: off). draft_budget: the most rows one step feeds (None: (W + G)(N - 1), the W, N, G step's).
    cost_file: where measured step costs are kept between runs (None: measured once per process and model).
    costs: step costs to use instead of measuring (benchmarks and tests).
    history: earlier answers to draft from as well (suffix_draft tokens, suffix_branches drafts); each generation
    adds its own new tokens to it when it ends, unless it is frozen. Shared by every generation given it.
    shared: the passes this generation shares with others, if any: its steps are then sized for the whole pass
    (best_plan's costs and other_tokens). Only speed depends on it: a greedy answer is the same whatever the plans.
    """

    suffix_draft: int = field(default=16, metadata=option(
        "verify drafts of up to L tokens copied from where the text's ending occurred before (0 = off)",
        "--suffix-draft", metavar="L"))
    suffix_branches: int = field(default=4, metadata=option(
        "at most B suffix drafts a step, from occurrences that disagree", "--suffix-branches", metavar="B"))
    recycle_topk: int = field(default=0, metadata=option(
        "also draft from the model's own top-K next tokens after every token it read (token recycling, a "
        "(vocabulary x K) table; 0 = off)", "--recycle-topk", metavar="K"))
    draft_budget: int | None = field(default=None, metadata=option(
        "the most rows one step feeds (default: (W + G) * (N - 1))", "--draft-budget", metavar="ROWS"))
    cost_file: str | None = None
    costs: StepCosts | None = field(default=None, compare=False, repr=False)
    history: DraftHistory | None = field(default=None, compare=False, repr=False)
    shared: SharedPasses | None = field(default=None, compare=False, repr=False)
    name = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        whole_number(self.suffix_draft, "suffix_draft (longest suffix draft, 0 = off)", minimum=0)
        whole_number(self.suffix_branches, "suffix_branches (suffix drafts per step)", minimum=1)
        whole_number(self.recycle_topk, "recycle_topk (recycled next tokens per token, 0 = off)", minimum=0)
        if self.draft_budget is not None:
            whole_number(self.draft_budget, "draft_budget (rows per step)", minimum=1)
        if self.history is not None and not isinstance(self.history, DraftHistory):
            raise ValueError(f"history must be a DraftHistory, got {type(self.history).__name__}")

    @property
    def budget(self) -> int:
        return self.layout.max_rows if self.draft_budget is None else self.draft_budget

    def max_step_tokens(self) -> int:
        return self.budget

    def fit(self, context: int, room: int) -> "Auto":
        """Steps of at most `room` rows (the positions left after the prompt): the budget shrinks to it, and the
        window's W and N with it, so that the window's rows fit the budget. Greedy output is unchanged (every
        step is verified); on a roomy context this is the strategy itself."""
        if self.budget <= room:
            return self
        budget = max(1, room)
        ngram = min(self.ngram, budget + 1)
        window = max(1, min(self.window, budget // (ngram - 1)))
        return dataclasses.replace(self, draft_budget=budget, ngram=ngram, window=window)

    def make_decoder(self, ctx: DecodeContext) -> Decoder:
        return AutoDecoder(ctx, self)

    def cost_sizes(self) -> list[int]:
        """The step sizes whose costs its plans weigh: COST_SIZES up to the budget, the budget, and the window's."""
        sizes = {T for T in COST_SIZES if T <= self.budget} | {self.budget}
        n_window = self.layout.n_window_rows
        if n_window <= self.budget:
            sizes |= {n_window, min(self.budget, n_window + self.layout.guesses)}
        return sorted(sizes)

    def step_costs(self, model: Transformer, agree: Agree = single_process) -> StepCosts:
        """`costs` where given, else the model's step costs at cost_sizes() (measured once, kept in cost_file)."""
        return self.costs or step_costs_for(model, self.cost_sizes(), self.cost_file, agree=agree)

    def __str__(self) -> str:
        history = f", history of {len(self.history)} tokens" if self.history is not None else ""
        return (f"auto(W<={self.window}, N<={self.ngram}, G<={self.guesses}, suffix {self.suffix_branches}x"
                f"{self.suffix_draft}{history}, <= {self.budget} rows)")


def best_plan(chances: list[float], costs: Callable[[int], float], budget: int, window_rows: int | None = None,
              window_gain: float = 0.0, other_tokens: float = 0.0, all_plain: float = 0.0
              ) -> tuple[bool, int, float]:
    """(with the window, b, expected tokens): feed x and the first b nodes of `chances` (ranked, ancestors first),
    and the window of window_rows rows (x included) too if that pays, so that expected tokens per second, under
    `costs` (seconds of the step as a function of its rows), are highest and no step feeds more than `budget` rows.
    b = 0 without the window is a plain step. The expected tokens of a step are 1 + the chances fed (+ window_gain
    with the window).

    In a forward pass shared with other generations (a server's), `costs` is the whole pass's, as a function of
    this generation's rows (SharedPasses.others), and other_tokens the tokens the others' rows are expected to emit:
    the pass's worth is all their tokens, so a draft row pays only if it adds more to the pass's tokens per second
    than it slows every generation in it; and a drafted plan must also beat all_plain, the pass's tokens per second
    with every generation plain. Weighing its plans against the others' as they are, each generation may find
    drafting best because the others draft, where all of them would be faster plain (in compiled shared passes the
    last one-row call of a pass costs a whole step of its own): all_plain is what they would all go back to."""
    expected = [1.0]
    for c in chances:
        expected.append(expected[-1] + c)
    best, score = (False, 0, 1.0), max((other_tokens + 1.0) / costs(1), all_plain)
    bases = [(False, 1)] + ([(True, window_rows)] if window_rows is not None else [])
    for with_window, base in bases:
        for b in range(min(len(chances), budget - base) + 1):
            gain = expected[b] + (window_gain if with_window else 0.0)
            rate = (other_tokens + gain) / costs(base + b)
            if rate > score:
                best, score = (with_window, b, gain), rate
    return best


@dataclass(frozen=True)
class Plan:
    with_window: bool
    nodes: list[int]   # the draft tree's nodes to feed, ancestors first
    rows: int          # fed to the model
    expected: float    # tokens the step is expected to emit
    keys: list[Key] = field(default_factory=list)  # the nodes' calibration keys: (source, bucket)


def draft_sources(settings: Auto, pool, suffix: SuffixIndex, ctx: DecodeContext) -> list[DraftSource]:
    """Auto's sources, in the order their paths are merged (suffix drafts first: ties in chance go to them)."""
    sources: list[DraftSource] = []
    if settings.suffix_draft:
        sources.append(SuffixDrafts(suffix, settings.suffix_draft, settings.suffix_branches))
        if settings.history is not None:
            sources.append(HistoryDrafts(settings.history, settings.suffix_draft, settings.suffix_branches))
    if settings.guesses:
        sources.append(PoolDrafts(pool, settings.guesses))
    if settings.recycle_topk:
        table = RecycleTable(ctx.model.config.vocab_size, settings.recycle_topk, ctx.device)
        sources.append(RecycledDrafts(table, RECYCLE_WIDTHS))
    return sources


class AutoDecoder(Decoder):
    # A probe (the most likely node alone) after at least EXPLORE_EVERY plain steps in a row, and once the tokens it
    # costs the pass are at most EXPLORE_SHARE of theirs: alone a second row is nearly free (a probe every 32 or so
    # steps); in a compiled shared pass it is a wider call costing about its own step, and every generation in the
    # pass waits for it (rarely or never).
    EXPLORE_EVERY = 32
    EXPLORE_SHARE = 0.003
    # Planning a step (every source's drafts, merged and weighed: some 0.1-0.2 ms of Python) costs the same whatever
    # it decides, and in a shared pass every generation waits for the others' planning. After PLAN_ALWAYS plain
    # steps in a row, only every PLAN_EVERY-th step plans; the others are plain without weighing (a greedy answer
    # never depends on its plans; a sampled one is still drawn from the model's distribution). In a pass of n
    # generations the interval is PLAN_EVERY * n / 2: a plan delays the whole pass by its own time, while a draft it
    # finds adds tokens to one generation of n (8 requests in a server's engine, in process, medians of 4 alternated
    # rounds: x0.956 / x0.983 of plain decoding's tokens/s on chat planning every 4th / 16th step, x0.953 / x0.966
    # on code; at 4 requests, every 4th / 8th step: x1.03 / x1.03 on chat, x1.06 / x1.04 on code).
    PLAN_ALWAYS = 8
    PLAN_EVERY = 4
    DECAY = 0.97  # per step, for the window's running credit

    def __init__(self, ctx: DecodeContext, settings: Auto) -> None:
        super().__init__(ctx)
        self.layout = layout = settings.layout
        self.budget, self.history, self.prompt_length = settings.budget, settings.history, len(ctx.tokens)
        self.shared = settings.shared
        self.window = JacobiWindow(layout, ctx.tokens, settings.seed)
        self.pool = text_pool(layout.ngram, settings.pool_capacity or max(layout.guesses, 1), ctx.tokens,
                              settings.pool_from_prompt)
        self.window_shape = StepShape(layout, with_window=True, device=ctx.device)
        self.verify_shape = StepShape(layout, with_window=False, device=ctx.device)
        suffix = SuffixIndex()
        self.sources = draft_sources(settings, self.pool, suffix, ctx)
        self.costs = settings.step_costs(ctx.model, ctx.agree)
        self.calibration = Calibration(PRIORS)
        start = max(0, len(ctx.tokens) - PROMPT_REPLAY)
        suffix.update(ctx.tokens[:start])
        replay_calibration(self.calibration, ctx.tokens, start,
                           text_sources(layout.ngram, layout.guesses, settings.suffix_draft,
                                        settings.suffix_branches, suffix))
        # The window's worth: tokens accepted from candidates only the window made, per step that ran it.
        self.window_credit, self.window_steps = 0.5, 1.0  # a prior of half a token per window step
        self.since_verify = 0  # plain steps since the last drafted one

    def step(self) -> Step:
        ctx = self.ctx
        room = ctx.limit - 1 - ctx.cache.length  # the longest draft whose positions stay inside the context
        plan, tree = Plan(False, [], 1, 1.0), None
        if room >= 1 and self.since_verify >= self.PLAN_ALWAYS and self.since_verify % self.plan_every():
            self.since_verify += 1  # a plain step, unplanned
        elif room >= 1:
            self.pool.add_text(ctx.tokens)
            paths = [path for source in self.sources for path in source.paths(ctx.tokens, room)]
            tree = DraftTree.merge(paths, self.calibration, max_depth=room)
            plan = self.choose(tree)
        if self.shared is not None:
            self.shared.plan(plan.rows, plan.expected)
        if not plan.nodes and not plan.with_window:
            return self.single_step()
        return self.drafted_step(plan, tree.paths(plan.nodes))

    def plan_every(self) -> int:
        """Steps between plans after PLAN_ALWAYS plain ones: PLAN_EVERY alone, more in a crowded shared pass."""
        sharing = self.shared.generations() if self.shared is not None else 1
        return self.PLAN_EVERY * max(1, sharing // 2)

    def drafted_step(self, plan: Plan, paths: list[DraftPath]) -> Step:
        """One packed step over x (and the window, when the plan has it) and the chosen paths' trie."""
        x = self.ctx.tokens[-1]
        shape = self.window_shape if plan.with_window else self.verify_shape
        base = self.window.rows(x) if plan.with_window else torch.tensor([x])
        tree = CandidateTree.of([p.tokens for p in paths])
        verdict, new_level = packed_step(self.ctx, shape, base, tree, observe=self.observe)
        emitted = self.emit(verdict.emitted)
        if plan.with_window:
            for ngram in self.window.advance(new_level):
                self.pool.add(ngram[0], ngram[1:], from_window=True)
        self.learn(plan, paths, verdict)
        kind = StepKind(window=plan.with_window, paths=tree.n_paths, depth=tree.path_length)
        fed = Counter(key[0] for key in plan.keys)
        fed["window"] += shape.n_base - 1
        n_extra = len(emitted) - 1
        accepted = Counter(key[0] for key in paths[verdict.winner].keys[:n_extra]) if n_extra else Counter()
        return Step(emitted, kind, shape.n_base + tree.size, verdict, +fed, accepted)

    def observe(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        for source in self.sources:
            source.observe(tokens, logits)

    def finish(self, handed_out: int) -> None:
        if self.history is not None:
            self.history.add(self.ctx.tokens[self.prompt_length:self.prompt_length + handed_out])

    def choose(self, tree: DraftTree) -> Plan:
        """The plan with the most expected tokens per second (of the whole pass, when it is shared): b nodes, with
        or without the window; after enough plain steps in a row (EXPLORE_EVERY, EXPLORE_SHARE), a probe of the
        most likely node."""
        ranked = tree.ranked()
        window_rows = self.window_shape.n_base if window_fits(self.ctx, self.layout) else None
        window_gain = self.window_credit / self.window_steps
        costs, other_tokens, all_plain = (self.shared.others(self.costs) if self.shared is not None
                                          else (self.costs, 0.0, 0.0))
        with_window, b, expected = best_plan([tree.chance[i] for i in ranked], costs, self.budget, window_rows,
                                             window_gain, other_tokens, all_plain)
        self.window_credit *= self.DECAY
        self.window_steps *= self.DECAY
        if b or with_window:
            self.since_verify = 0
            return Plan(with_window, ranked[:b], (window_rows if with_window else 1) + b, expected,
                        [tree.key[i] for i in ranked[:b]])
        lost = (costs(2) / costs(1) - 1) * (1 + other_tokens)  # the pass's tokens a probe's second row costs
        if ranked and self.since_verify >= max(self.EXPLORE_EVERY, lost / self.EXPLORE_SHARE):
            self.since_verify = 0
            return Plan(False, ranked[:1], 2, 1.0 + tree.chance[ranked[0]], [tree.key[ranked[0]]])  # a probe
        self.since_verify += 1
        return Plan(False, [], 1, 1.0)

    def learn(self, plan: Plan, paths: list[DraftPath], verdict: Verdict) -> None:
        self.calibration.learn(paths, verdict.matches)
        self.window_steps += plan.with_window
        if verdict.n_accepted:
            keys = paths[verdict.winner].keys[:verdict.n_accepted]
            self.window_credit += sum(source == "window" for source, _ in keys)
