"""Lookahead decoding (Fu et al., 2024): parallel decoding without a draft model.

Each step is one forward pass over two branches packed side by side (geometry in masks.py):
- the lookahead branch, a W x (N-1) window of a Jacobi iteration. Its newest level's outputs form a new level;
  each column then spells an n-gram, which goes into the pool;
- the verification branch, up to G candidate n-grams from the pool that start with the input token. The model's
  own choices along them decide how many candidate tokens are accepted (greedy or lossless sampling).
A step emits the accepted tokens plus the model's next token, so at least one token, at most N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import LookaheadLayout
from .ngram_pool import NGramPool
from .strategies import DecodeContext, Decoder, Strategy
from .verify import greedy_verify, sample_verify


@dataclass(frozen=True)
class Lookahead(Strategy):
    """window W, ngram N, guesses G (see masks.py). pool_capacity: continuations kept per key (default G).
    seed: the initial window is drawn from the prompt with it, so step counts are reproducible."""

    window: int = 5
    ngram: int = 4
    guesses: int = 5
    pool_from_prompt: bool = True
    pool_capacity: int | None = None
    seed: int = 0
    name = "lookahead"

    def __post_init__(self) -> None:
        LookaheadLayout(self.window, self.ngram, self.guesses)  # validates W, N, G
        if self.pool_capacity is not None and self.pool_capacity < 1:
            raise ValueError(f"pool capacity must be >= 1, got {self.pool_capacity}")

    @property
    def layout(self) -> LookaheadLayout:
        return LookaheadLayout(self.window, self.ngram, self.guesses)

    def max_step_tokens(self) -> int:
        return self.layout.max_rows

    def make_decoder(self, ctx: DecodeContext) -> Decoder:
        return LookaheadDecoder(ctx, self)

    def __str__(self) -> str:
        return f"lookahead(W={self.window}, N={self.ngram}, G={self.guesses})"


@dataclass
class StepOutcome:
    emitted: list[int]
    winner: int             # index of the accepted candidate (meaningful when n_accepted > 0)
    n_accepted: int         # candidate tokens accepted
    new_level: list[int]    # the lookahead branch's new level (W,)


class LookaheadDecoder(Decoder):
    def __init__(self, ctx: DecodeContext, settings: Lookahead) -> None:
        super().__init__(ctx)
        self.layout = layout = settings.layout
        self.mask = layout.mask().to(ctx.device)
        self.offsets = layout.offsets().to(ctx.device)
        self.pool = NGramPool(settings.ngram, settings.pool_capacity or max(settings.guesses, 1))
        prompt = ctx.tokens
        if settings.pool_from_prompt:
            self.pool.add_ngrams(prompt)
        self.ngram_start = max(0, len(prompt) - settings.ngram + 1)  # first n-gram not yet pooled
        # The window starts as prompt tokens drawn with a seeded generator; [0, 0] is where the input token goes.
        gen = torch.Generator().manual_seed(settings.seed)
        picks = torch.randint(len(prompt), (layout.levels, layout.window), generator=gen)
        self.window = torch.tensor(prompt)[picks]  # (N-1, W), on the host
        self.model_levels = 0  # how many of the window's levels the model has produced so far

    def step(self) -> list[int]:
        ctx, layout = self.ctx, self.layout
        if ctx.cache.length + layout.max_offset >= ctx.limit:
            return self._single_step()  # too close to the end of the context for the window's positions
        self.pool.add_ngrams(ctx.tokens, self.ngram_start)
        self.ngram_start = max(0, len(ctx.tokens) - layout.ngram + 1)
        x = ctx.tokens[-1]
        candidates = torch.tensor(self.pool.candidates(x, layout.guesses), dtype=torch.long)
        candidates = candidates.view(-1, layout.levels)  # (g, N-1)
        outcome = self._forward_and_verify(x, candidates)
        self._commit(outcome, candidates.shape[0])
        self._advance_window(x, outcome.new_level)
        return self._emit(outcome.emitted)

    def _forward_and_verify(self, x: int, candidates: torch.Tensor) -> StepOutcome:
        ctx, layout = self.ctx, self.layout
        g, device = candidates.shape[0], ctx.device
        window = self.window.flatten()
        window[0] = x
        tokens = torch.cat([window, candidates.flatten()]).to(device)
        T = tokens.numel()
        # Rows read back: the input token (unless it already is in the newest level), newest level, candidates.
        head = [] if layout.levels == 1 else [0]
        rows = torch.cat([torch.tensor(head, dtype=torch.long), layout.last_level_rows(),
                          layout.candidate_rows(g).flatten()]).to(device)
        logits = ctx.model(tokens[None], ctx.cache.length + self.offsets[:T], ctx.cache,
                           self.mask[:T, :T], logits_rows=rows)[0]  # (R, V)
        n_head = len(head)
        new_level = logits[n_head:n_head + layout.window].argmax(-1)  # the lookahead branch is always greedy
        first_logits = logits[0]
        cand_logits = logits[n_head + layout.window:].view(g, layout.levels, logits.shape[-1])
        cand_dev = candidates.to(device)
        sampler = ctx.sampler
        if sampler.greedy:
            first = first_logits.argmax(-1)
            if g:
                best, n_acc, emitted = greedy_verify(first, cand_dev, cand_logits.argmax(-1))
            else:
                best, n_acc, emitted = first.new_zeros(()), first.new_zeros(()), first.view(1)
        else:
            probs0 = sampler.probs(first_logits)
            if g:
                best, n_acc, emitted = sample_verify(probs0, cand_dev, cand_logits, sampler)
            else:
                best, n_acc, emitted = new_level.new_zeros(()), new_level.new_zeros(()), sampler.draw(probs0).view(1)
        readback = torch.cat([best.view(1), n_acc.view(1), emitted, new_level]).tolist()  # the one host sync
        best, n_acc = readback[0], readback[1]
        emitted = readback[2:2 + emitted.numel()][:n_acc + 1]
        return StepOutcome(emitted, best, n_acc, readback[-layout.window:])

    def _commit(self, outcome: StepOutcome, n_candidates: int) -> None:
        """Keep the K/V of the input token and of the accepted candidate tokens; drop the rest of the step."""
        cache = self.ctx.cache
        if outcome.n_accepted == 0:
            cache.commit(1)
            return
        rows = self.layout.candidate_rows(n_candidates)[outcome.winner, :outcome.n_accepted]
        cache.compact(torch.cat([torch.zeros(1, dtype=torch.long), rows]).to(self.ctx.device))

    def _advance_window(self, x: int, new_level: list[int]) -> None:
        """Pool the n-grams the window's columns spell, then shift the levels down and append the new one."""
        new = torch.tensor(new_level, dtype=torch.long)[None]
        self.window[0, 0] = x
        if self.model_levels >= self.layout.levels - 1:  # levels 1..N-2 are the model's own: real n-grams
            for column in torch.cat([self.window, new]).T.tolist():
                self.pool.add(column[0], tuple(column[1:]))
        self.window = torch.cat([self.window[1:], new])
        self.model_levels += 1
