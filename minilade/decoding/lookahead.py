"""Lookahead decoding (Fu et al., 2024): parallel decoding without a draft model.

Each step is one forward pass over two branches packed side by side (geometry and mask: masks.py):
- the lookahead branch, a W x (N-1) window of a Jacobi iteration (JacobiWindow). The model's outputs at the newest
  level form a new level; each column of the window and the new level then spells an n-gram for the pool;
- the verification branch, up to G continuations of the input token x from the n-gram pool (ngram_pool.py), laid
  out as a trie. The model's own choices along them decide how many candidate tokens are accepted (verify.py).
The accepted tokens' keys and values are kept in the cache, the rest of the step's rows dropped (kv_cache.py). A
step emits the accepted tokens plus the model's next token: at least one token, at most N.

    step():  pool the text's new n-grams -> candidates for x -> packed_step (inputs, forward, verify, commit)
             -> emit -> the window moves down a level, its columns' n-grams go into the pool
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..masks import CandidateTree, LookaheadLayout, StepShape
from ..ngram_pool import NGramPool
from ..verify import Verdict, verify_tree
from .base import DecodeContext, Decoder, Step, StepKind, Strategy, option, whole_number


@dataclass(frozen=True)
class WindowAndPool:
    """The paper's settings, shared by Lookahead and Auto: window W, ngram N, guesses G (see masks.py).
    pool_capacity: continuations kept per key (None: G). seed: the initial window is drawn from the prompt with it,
    so step counts are reproducible."""

    window: int = field(default=5, metadata=option("lookahead window W (columns)", "--window", "-W", metavar="W"))
    ngram: int = field(default=4, metadata=option("n-gram size N (the window keeps N - 1 levels)", "--ngram", "-N",
                                                         metavar="N"))
    guesses: int = field(default=5, metadata=option("candidates from the pool verified per step G", "--guesses",
                                                    "-G", metavar="G"))
    pool_from_prompt: bool = field(default=True, metadata=option("do not seed the n-gram pool from the prompt",
                                                                 "--no-prompt-pool"))
    pool_capacity: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        LookaheadLayout(self.window, self.ngram, self.guesses)  # validates W, N, G
        if self.pool_capacity is not None:
            whole_number(self.pool_capacity, "pool_capacity (continuations kept per key)", minimum=1)

    @property
    def layout(self) -> LookaheadLayout:
        return LookaheadLayout(self.window, self.ngram, self.guesses)


@dataclass(frozen=True)
class Lookahead(WindowAndPool, Strategy):
    """The paper's algorithm. bonus_token: after a wholly accepted candidate also emit the model's next token (up
    to N tokens a step); False caps a step at N - 1 tokens as the published reference does."""

    bonus_token: bool = True
    name = "lookahead"

    def max_step_tokens(self) -> int:
        return self.layout.max_rows

    def make_decoder(self, ctx: DecodeContext) -> Decoder:
        return LookaheadDecoder(ctx, self)

    def __str__(self) -> str:
        return f"lookahead(W={self.window}, N={self.ngram}, G={self.guesses})"


class JacobiWindow:
    """The lookahead branch's tokens: (N-1, W), level l column c guessing position x's + l + c.

    Level 0, column 0 is the input token x. At the start every slot holds a prompt token drawn with a seeded
    generator; each step the model's outputs at the newest level become a new level and the oldest level drops
    out, so after N - 2 steps every level above level 0 is the model's own.
    """

    def __init__(self, layout: LookaheadLayout, prompt: Sequence[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        picks = torch.randint(len(prompt), (layout.levels, layout.window), generator=gen)
        self.tokens = torch.tensor(list(prompt))[picks]  # (N-1, W), on the host
        self.levels_written = 0  # levels the model has produced so far

    def rows(self, x: int) -> torch.Tensor:
        """(W * (N-1),) the branch's input rows, level by level, with x in slot (0, 0)."""
        self.tokens[0, 0] = x
        return self.tokens.flatten()

    def advance(self, new_level: list[int]) -> list[tuple[int, ...]]:
        """Take the model's new level (W,); return the n-grams the columns spelled (none while the upper levels
        still hold prompt tokens): each column of the levels and the new level, top to bottom."""
        new = torch.tensor(new_level, dtype=torch.long)[None]
        ngrams = []
        if self.levels_written >= self.tokens.shape[0] - 1:
            ngrams = [tuple(column) for column in torch.cat([self.tokens, new]).T.tolist()]
        self.tokens = torch.cat([self.tokens[1:], new])
        self.levels_written += 1
        return ngrams


class LookaheadDecoder(Decoder):
    def __init__(self, ctx: DecodeContext, settings: Lookahead) -> None:
        super().__init__(ctx)
        self.layout = settings.layout
        self.max_accepted = None if settings.bonus_token else self.layout.levels - 1
        self.shape = StepShape(self.layout, with_window=True, device=ctx.device)
        self.pool = text_pool(settings.ngram, settings.pool_capacity or max(settings.guesses, 1), ctx.tokens,
                              settings.pool_from_prompt)
        self.window = JacobiWindow(self.layout, ctx.tokens, settings.seed)

    def step(self) -> Step:
        ctx = self.ctx
        if not window_fits(ctx, self.layout):
            return self.single_step()
        x = ctx.tokens[-1]
        self.pool.add_text(ctx.tokens)
        tree = CandidateTree.of(self.pool.candidates(x, self.layout.guesses))
        verdict, new_level = packed_step(ctx, self.shape, self.window.rows(x), tree, self.max_accepted)
        emitted = self.emit(verdict.emitted)
        for ngram in self.window.advance(new_level):
            self.pool.add(ngram[0], ngram[1:], from_window=True)
        kind = StepKind(window=True, paths=tree.n_paths, depth=tree.path_length)
        fed, accepted = +Counter(window=self.shape.n_base - 1, pool=tree.size), +Counter(pool=len(emitted) - 1)
        return Step(emitted, kind, self.shape.n_base + tree.size, verdict, fed, accepted)


def window_fits(ctx: DecodeContext, layout: LookaheadLayout) -> bool:
    """Whether every position a window step uses lies inside the context (x sits at cache.length)."""
    return ctx.cache.length + layout.max_offset < ctx.limit


def text_pool(ngram: int, capacity: int, prompt: Sequence[int], from_prompt: bool) -> NGramPool:
    """An n-gram pool that follows the text (NGramPool.add_text), with the prompt's n-grams unless from_prompt
    is False (then it starts at the prompt's end)."""
    pool = NGramPool(ngram, capacity)
    if from_prompt:
        pool.add_text(prompt)
    else:
        pool.skip_text(prompt)
    return pool


def packed_step(ctx: DecodeContext, shape: StepShape, base: torch.Tensor, tree: CandidateTree,
                max_accepted: int | None = None,
                observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> tuple[Verdict, list[int]]:
    """One forward pass over a step's base rows (x, or the window with x in it; `base` (n_base,) on the host) and
    a trie of candidates; verifies them and keeps the accepted tokens' keys and values in the cache.

    Returns the verdict and the window's new level (W,): the model's argmax at the newest level's rows (greedy
    even when sampling, as the lookahead branch only proposes; empty without the window). observe(tokens, logits),
    when given, sees the tokens fed at the rows read (R,) and their logits (R, V).
    """
    mask, offsets, read = shape.assemble(tree)
    tokens = torch.cat([base, tree.tokens]).to(ctx.device)
    logits = ctx.model(tokens[None], ctx.cache.length + offsets, ctx.cache, mask, logits_rows=read)  # (1, R, V)
    if observe is not None:
        observe(tokens[read], logits[0])
    verdict, new_level = verify_tree(ctx.sampler, logits, shape, tree, max_accepted)
    keep_accepted(ctx, shape, tree, verdict)
    return verdict, new_level


def keep_accepted(ctx: DecodeContext, shape: StepShape, tree: CandidateTree, verdict: Verdict) -> None:
    """Keep the keys and values of x and of the accepted candidate tokens; drop the rest of the step's rows."""
    if verdict.n_accepted == 0:
        ctx.cache.commit(1)
        return
    nodes = tree.node_of[verdict.winner, :verdict.n_accepted] + shape.n_base
    ctx.cache.compact(torch.cat([torch.zeros(1, dtype=torch.long), nodes]).to(ctx.device))
