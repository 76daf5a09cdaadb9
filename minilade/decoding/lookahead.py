"""Lookahead decoding (Fu et al., 2024): parallel decoding without a draft model.

Each step is one forward pass over two branches packed side by side (geometry in minilade/masks.py):
- the lookahead branch, a W x (N-1) window of a Jacobi iteration. Its newest level's outputs form a new level;
  each column then spells an n-gram, which goes into the pool;
- the verification branch, up to G candidate n-grams from the pool that start with the input token. The model's
  own choices along them decide how many candidate tokens are accepted (greedy or lossless sampling).
A step emits the accepted tokens plus the model's next token, so at least one token, at most N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import CandidateTree, LookaheadLayout, StepShape
from ..ngram_pool import NGramPool
from ..verify import greedy_verify, sample_verify
from .base import DecodeContext, Decoder, Step, Strategy


@dataclass(frozen=True)
class Lookahead(Strategy):
    """window W, ngram N, guesses G (see masks.py). pool_capacity: continuations kept per key (default G).
    seed: the initial window is drawn from the prompt with it, so step counts are reproducible.
    bonus_token: after a wholly accepted candidate also emit the model's next token (up to N tokens a step);
    False caps a step at N - 1 tokens as the published reference does, for comparisons with it."""

    window: int = 5
    ngram: int = 4
    guesses: int = 5
    pool_from_prompt: bool = True
    pool_capacity: int | None = None
    seed: int = 0
    bonus_token: bool = True
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
class Verdict:
    """What verification decided in one lookahead step (read back from the device in one transfer)."""

    emitted: list[int]
    winner: int             # index of the accepted candidate (meaningful when n_accepted > 0)
    n_accepted: int         # candidate tokens accepted
    matches: list[int]      # per candidate: leading tokens equal to the model's argmax chain (for estimates)
    new_level: list[int]    # the lookahead branch's new level (W,), empty for a step without the window


class LookaheadDecoder(Decoder):
    def __init__(self, ctx: DecodeContext, settings: Lookahead) -> None:
        super().__init__(ctx)
        self.layout = layout = settings.layout
        self.bonus_token = settings.bonus_token
        self.full_shape = StepShape(layout, with_window=True, device=ctx.device)
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

    def step(self) -> Step:
        if self.near_end_of_context():
            return self.single_step()
        return self.run_step(self.full_shape, self.candidates(self.layout.guesses), self.layout.levels)

    def near_end_of_context(self) -> bool:
        """Too close to the end of the context for the window's positions."""
        return self.ctx.cache.length + self.layout.max_offset >= self.ctx.limit

    def candidates(self, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` continuations of the input token, after pooling the n-grams the text gained."""
        self.pool.add_ngrams(self.ctx.tokens, self.ngram_start)
        self.ngram_start = max(0, len(self.ctx.tokens) - self.layout.ngram + 1)
        return self.pool.candidates(self.ctx.tokens[-1], limit)

    def run_step(self, shape: StepShape, candidates: list[tuple[int, ...]], cand_len: int) -> Step:
        """One forward pass over the shape's base rows and the candidates cut to cand_len tokens; commits the
        accepted tokens' K/V, advances the window (if it ran) and emits. The Step's detail is the Verdict."""
        x = self.ctx.tokens[-1]
        cands = torch.tensor([c[:cand_len] for c in candidates], dtype=torch.long).view(-1, cand_len)
        tree = CandidateTree.build(cands)
        verdict = self._forward_and_verify(shape, x, cands, tree)
        self._commit(shape, tree, verdict)
        if shape.with_window:
            self._advance_window(x, verdict.new_level)
        return Step(self.emit(verdict.emitted), shape.kind(len(candidates), cand_len), shape.n_base + tree.size,
                    verdict)

    def _forward_and_verify(self, shape: StepShape, x: int, candidates: torch.Tensor,
                            tree: CandidateTree) -> Verdict:
        ctx, layout = self.ctx, self.layout
        g, device = candidates.shape[0], ctx.device
        if shape.with_window:
            base = self.window.flatten()  # a view: this also puts x into the window's slot [0, 0]
            base[0] = x
        else:
            base = torch.tensor([x])
        tokens = torch.cat([base, tree.tokens]).to(device)
        mask, offsets, read = shape.assemble(tree)
        logits = ctx.model(tokens[None], ctx.cache.length + offsets, ctx.cache, mask, logits_rows=read)[0]  # (R, V)
        n_read, first_logits = len(shape.read), logits[0]
        if shape.with_window:  # the lookahead branch only proposes, so it is greedy even when sampling
            new_level = logits[n_read - layout.window:n_read].argmax(-1)
        else:
            new_level = torch.zeros(0, dtype=torch.long, device=device)
        cand_logits = logits[n_read:][tree.node_of.to(device)]  # (g, k, V): each candidate token's node
        cand_dev = candidates.to(device)
        first_choice = first_logits.argmax(-1)
        best, n_acc, matches, emitted = self._verify(first_choice, first_logits, cand_dev, cand_logits)
        # The one host sync of the step.
        readback = torch.cat([best.view(1), n_acc.view(1), matches, emitted, new_level]).tolist()
        best, n_acc = readback[0], readback[1]
        matches, rest = readback[2:2 + g], readback[2 + g:]
        return Verdict(rest[:n_acc + 1], best, n_acc, matches, rest[emitted.numel():])

    def _verify(self, first_choice: torch.Tensor, first_logits: torch.Tensor, candidates: torch.Tensor,
                cand_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(winner, accepted count, per-candidate argmax matches, emitted chain) on the device."""
        sampler = self.ctx.sampler
        if candidates.shape[0] == 0:
            zero = first_choice.new_zeros(())
            token = first_choice if sampler.greedy else sampler.draw(sampler.probs(first_logits))
            return zero, zero, first_choice.new_zeros(0), token.view(1)
        best, n_acc, chain, matches = greedy_verify(first_choice, candidates, cand_logits.argmax(-1))
        if not sampler.greedy:
            best, n_acc, chain = sample_verify(sampler.probs(first_logits), candidates, cand_logits, sampler)
        if not self.bonus_token:
            n_acc = n_acc.clamp(max=candidates.shape[1] - 1)
        return best, n_acc, matches, chain

    def _commit(self, shape: StepShape, tree: CandidateTree, verdict: Verdict) -> None:
        """Keep the K/V of the input token and of the accepted candidate tokens; drop the rest of the step."""
        cache = self.ctx.cache
        if verdict.n_accepted == 0:
            cache.commit(1)
            return
        nodes = tree.node_of[verdict.winner, :verdict.n_accepted] + shape.n_base
        cache.compact(torch.cat([torch.zeros(1, dtype=torch.long), nodes]).to(self.ctx.device))

    def _advance_window(self, x: int, new_level: list[int]) -> None:
        """Pool the n-grams the window's columns spell, then shift the levels down and append the new one."""
        new = torch.tensor(new_level, dtype=torch.long)[None]
        self.window[0, 0] = x
        if self.model_levels >= self.layout.levels - 1:  # levels 1..N-2 are the model's own: real n-grams
            for column in torch.cat([self.window, new]).T.tolist():
                self.pool.add(column[0], tuple(column[1:]), from_window=True)
        self.window = torch.cat([self.window[1:], new])
        self.model_levels += 1
