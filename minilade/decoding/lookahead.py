"""Lookahead decoding (Fu et al., 2024): parallel decoding without a draft model.

Each step is one forward pass over two branches packed side by side (geometry in minilade/masks.py):
- the lookahead branch, a W x (N-1) window of a Jacobi iteration. Its newest level's outputs form a new level;
  each column then spells an n-gram, which goes into the pool;
- the verification branch, up to G candidate n-grams from the pool that start with the input token. The model's
  own choices along them decide how many candidate tokens are accepted (greedy or lossless sampling).
A step emits the accepted tokens plus the model's next token, so at least one token, at most N.

Options beyond the paper (off by default, so Lookahead(W, N, G) stays the published algorithm): suffix drafts
(minilade/drafts/suffix.py), paths of up to `suffix_draft` tokens copied from where the text's ending occurred
before, verified in the same trie as the pool's candidates (candidates may then differ in length, and a step may
emit more than N tokens); token recycling (minilade/drafts/recycle.py), `recycle_topk` chains of N - 1 tokens
drafted from the model's own top-k next tokens recorded at every row it read. The window's own guesses (item 4 of
the drafts issue): `window_chain` also verifies the chain of the window's freshest guess for each position after
x; `reanchor` keeps the window aligned with x after a step that emitted several tokens (slot (l, c) guesses
position x's + l + c, so its columns move left by the extra tokens, and the columns that open take a suffix
draft's guesses); `seed_window` fills the first window from a suffix draft of the prompt instead of random
prompt tokens; `fill_levels` feeds only the levels the model has written at the start (level 0, then 0..1, ...),
as the reference code and TensorRT-LLM do, instead of N - 1 levels of which the upper ones are random tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafts.recycle import RecycleTable
from ..drafts.suffix import SuffixIndex
from ..drafts.tree import padded_tokens
from ..masks import CandidateTree, LookaheadLayout, StepShape
from ..ngram_pool import NGramPool
from ..verify import greedy_verify, sample_verify
from .base import DecodeContext, Decoder, Step, Strategy


@dataclass(frozen=True)
class Lookahead(Strategy):
    """window W, ngram N, guesses G (see masks.py). pool_capacity: continuations kept per key (default G).
    seed: the initial window is drawn from the prompt with it, so step counts are reproducible.
    bonus_token: after a wholly accepted candidate also emit the model's next token (up to N tokens a step);
    False caps a step at N - 1 tokens as the published reference does, for comparisons with it.
    suffix_draft: also verify suffix drafts of up to this many tokens each (0: none, the paper's algorithm);
    suffix_branches: at most this many of them a step (occurrences of the text's ending that disagree).
    recycle_topk: keep the model's top-k next tokens after every token it reads (a (V, k) table) and also verify
    k chains of N - 1 tokens drafted from it (0: off).
    window_chain: also verify the window's freshest guesses, a chain of W + N - 3 tokens (column 0 of levels
    1..N-2, then the newest level's other columns). reanchor: shift the window's columns by the tokens a step
    emitted beyond the one it assumes. seed_window: the first window from a suffix draft where the prompt has one.
    fill_levels: the first N - 2 window steps feed 1, 2, ... levels (each adds one) instead of all N - 1."""

    window: int = 5
    ngram: int = 4
    guesses: int = 5
    pool_from_prompt: bool = True
    pool_capacity: int | None = None
    seed: int = 0
    bonus_token: bool = True
    suffix_draft: int = 0
    suffix_branches: int = 1
    recycle_topk: int = 0
    window_chain: bool = False
    reanchor: bool = False
    seed_window: bool = False
    fill_levels: bool = False
    name = "lookahead"

    def __post_init__(self) -> None:
        LookaheadLayout(self.window, self.ngram, self.guesses)  # validates W, N, G
        if self.pool_capacity is not None and self.pool_capacity < 1:
            raise ValueError(f"pool capacity must be >= 1, got {self.pool_capacity}")
        whole_number(self.suffix_draft, "suffix_draft (longest suffix draft, 0 = off)", minimum=0)
        whole_number(self.suffix_branches, "suffix_branches (suffix drafts per step)", minimum=1)
        whole_number(self.recycle_topk, "recycle_topk (recycled next tokens per token, 0 = off)", minimum=0)

    @property
    def layout(self) -> LookaheadLayout:
        return LookaheadLayout(self.window, self.ngram, self.guesses)

    def max_step_tokens(self) -> int:
        chain = self.window + self.ngram - 3 if self.window_chain else 0
        return (self.layout.max_rows + self.suffix_branches * self.suffix_draft
                + self.recycle_topk * self.layout.levels + chain)

    def make_decoder(self, ctx: DecodeContext) -> Decoder:
        return LookaheadDecoder(ctx, self)

    def __str__(self) -> str:
        suffix = f", suffix {self.suffix_branches}x{self.suffix_draft}" if self.suffix_draft else ""
        recycle = f", recycle top-{self.recycle_topk}" if self.recycle_topk else ""
        return f"lookahead(W={self.window}, N={self.ngram}, G={self.guesses}{suffix}{recycle}{self.window_options()})"

    def window_options(self) -> str:
        on = [name for name in ("window_chain", "reanchor", "seed_window", "fill_levels") if getattr(self, name)]
        return ", " + ", ".join(on) if on else ""


def whole_number(value: object, what: str, minimum: int) -> None:
    """A one-line ValueError unless value is an int (not a bool) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be a whole number >= {minimum}, got {value!r}")


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
        self.suffix_draft, self.suffix_branches = settings.suffix_draft, settings.suffix_branches
        self.suffix = SuffixIndex()
        self.recycled = RecycleTable(ctx.model.config.vocab_size, settings.recycle_topk, ctx.device) \
            if settings.recycle_topk else None
        self.window_chain_on, self.reanchor = settings.window_chain, settings.reanchor
        self.unseeded = settings.seed_window  # the window still holds the random prompt tokens it started with
        # With fill_levels, a window step feeds the levels written so far: shapes of 1..N-2 levels.
        self.fill_shapes = [StepShape(LookaheadLayout(layout.window, f + 1, layout.guesses), True, ctx.device)
                            for f in range(1, layout.levels)] if settings.fill_levels else []

    def step(self) -> Step:
        if self.near_end_of_context():
            return self.single_step()
        candidates = self.suffix_candidates() + self.candidates(self.layout.guesses) + self.recycled_candidates()
        return self.run_step(self.window_shape(), candidates + self.chain_candidates())

    def window_shape(self) -> StepShape:
        """The shape of a step with the window: all N - 1 levels, or (fill_levels) those written so far."""
        if self.model_levels < len(self.fill_shapes):
            return self.fill_shapes[self.model_levels]
        return self.full_shape

    def window_chain(self) -> tuple[int, ...]:
        """The window's freshest guess for each position after x: slot (l, c) guesses position x's + l + c and
        the newest level (N - 2) is the freshest, so column 0 of levels 1..N-2, then the newest level's columns
        1..W-1 (W + N - 3 tokens). Empty until the model has written every level above level 0."""
        if self.model_levels < max(1, self.layout.levels - 1):
            return ()
        return tuple(self.window[1:, 0].tolist() + self.window[-1, 1:].tolist())

    def chain_candidates(self) -> list[tuple[int, ...]]:
        """The window's chain as a candidate, cut to the context's room (none when the option is off)."""
        if not self.window_chain_on:
            return []
        chain = self.window_chain()[:self.room()]
        return [chain] if chain else []

    def recycled_candidates(self) -> list[tuple[int, ...]]:
        """k chains of N - 1 tokens from the recycling table (none when the option is off)."""
        if self.recycled is None:
            return []
        widths = (self.recycled.k,) + (1,) * (self.layout.levels - 1)
        return [p.tokens for p in self.recycled.paths(self.ctx.tokens[-1], widths[:self.room()])]

    def near_end_of_context(self) -> bool:
        """Too close to the end of the context for the window's positions."""
        return self.ctx.cache.length + self.layout.max_offset >= self.ctx.limit

    def room(self) -> int:
        """The longest draft whose positions stay inside the context (x sits at cache.length)."""
        return self.ctx.limit - 1 - self.ctx.cache.length

    def suffix_candidates(self) -> list[tuple[int, ...]]:
        """The suffix drafts of this step (none when the option is off), cut to the context's room."""
        length = min(self.suffix_draft, self.room())
        if length < 1:
            return []
        return [d.tokens for d in self.suffix.drafts(self.ctx.tokens, length, self.suffix_branches)]

    def candidates(self, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` continuations of the input token, after pooling the n-grams the text gained."""
        self.pool.add_ngrams(self.ctx.tokens, self.ngram_start)
        self.ngram_start = max(0, len(self.ctx.tokens) - self.layout.ngram + 1)
        return self.pool.candidates(self.ctx.tokens[-1], limit)

    def run_step(self, shape: StepShape, candidates: list[tuple[int, ...]]) -> Step:
        """One forward pass over the shape's base rows and the candidates (of any lengths >= 1, a trie);
        commits the accepted tokens' K/V, advances the window (if it ran) and emits. The Step's detail is the
        Verdict."""
        x = self.ctx.tokens[-1]
        if shape.with_window and self.unseeded:
            self.fill_window_from_draft(0)
            self.unseeded = False
        cands, lengths = padded_tokens(candidates)
        tree = CandidateTree.build(cands, lengths)
        verdict = self._forward_and_verify(shape, x, tree)
        self._commit(shape, tree, verdict)
        emitted = self.emit(verdict.emitted)
        if shape.with_window:
            self._advance_window(x, verdict.new_level)
        self.moved(len(emitted) - shape.with_window)
        return Step(emitted, shape.kind(len(candidates), cands.shape[1] if candidates else 0),
                    shape.n_base + tree.size, verdict)

    def moved(self, shift: int) -> None:
        """x moved `shift` positions further than the window's slots assume (a window step assumes one): with
        `reanchor`, the columns move left by that much, so that slot (l, c) still guesses position x's + l + c,
        and the columns that open on the right take a suffix draft's guesses (or keep their old tokens)."""
        if not self.reanchor or shift <= 0:
            return
        W = self.layout.window
        s = min(shift, W)
        self.window = torch.cat([self.window[:, s:], self.window[:, W - s:]], dim=1)  # contiguous (N-1, W)
        self.fill_window_from_draft(W - s)

    def fill_window_from_draft(self, first_column: int) -> None:
        """Put a suffix draft of the text into the window's columns first_column..W-1: slot (l, c) takes the
        draft's guess for position x's + l + c. Nothing changes where the text's ending never occurred before."""
        levels, W = self.layout.levels, self.layout.window
        drafts = self.suffix.drafts(self.ctx.tokens, levels + W - 2)
        if not drafts:
            return
        guess = drafts[0].tokens  # guess[j]: for position x's + 1 + j
        for level in range(levels):
            for column in range(max(first_column, 1 - level), W):
                self.window[level, column] = guess[level + column - 1]

    def _forward_and_verify(self, shape: StepShape, x: int, tree: CandidateTree) -> Verdict:
        ctx, layout = self.ctx, self.layout
        g, device = tree.node_of.shape[0], ctx.device
        if shape.with_window:
            base = self.window[:shape.n_base // layout.window].flatten()  # a view: x goes into slot [0, 0] too
            base[0] = x
        else:
            base = torch.tensor([x])
        tokens = torch.cat([base, tree.tokens]).to(device)
        mask, offsets, read = shape.assemble(tree)
        logits = ctx.model(tokens[None], ctx.cache.length + offsets, ctx.cache, mask, logits_rows=read)[0]  # (R, V)
        n_read, first_logits = len(shape.read), ctx.sampler.penalize(logits[0])
        if self.recycled is not None:
            self.recycled.update(tokens[read], logits)
        if shape.with_window:  # the lookahead branch only proposes, so it is greedy even when sampling
            new_level = logits[n_read - layout.window:n_read].argmax(-1)
        else:
            new_level = torch.zeros(0, dtype=torch.long, device=device)
        candidates = tree.tokens[tree.node_of].to(device)  # (g, K), past a candidate's end: its last token again
        # (g, K, V): each candidate token's node, penalized with its own history (the committed text and the
        # candidate up to that token), as plain decoding would have it had it emitted them.
        cand_logits = ctx.sampler.penalize(logits[n_read:][tree.node_of.to(device)], candidates)
        first_choice = first_logits.argmax(-1)
        best, n_acc, matches, emitted = self._verify(first_choice, first_logits, candidates, cand_logits,
                                                     tree.lengths.to(device))
        # The one host sync of the step.
        readback = torch.cat([best.view(1), n_acc.view(1), matches, emitted, new_level]).tolist()
        best, n_acc = readback[0], readback[1]
        matches, rest = readback[2:2 + g], readback[2 + g:]
        return Verdict(rest[:n_acc + 1], best, n_acc, matches, rest[emitted.numel():])

    def _verify(self, first_choice: torch.Tensor, first_logits: torch.Tensor, candidates: torch.Tensor,
                cand_logits: torch.Tensor, lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(winner, accepted count, per-candidate argmax matches, emitted chain) on the device."""
        sampler = self.ctx.sampler
        if candidates.shape[0] == 0:
            zero = first_choice.new_zeros(())
            token = first_choice if sampler.greedy else sampler.draw(sampler.probs(first_logits))
            return zero, zero, first_choice.new_zeros(0), token.view(1)
        best, n_acc, chain, matches = greedy_verify(first_choice, candidates, cand_logits.argmax(-1), lengths)
        if not sampler.greedy:
            best, n_acc, chain = sample_verify(sampler.probs(first_logits), candidates, cand_logits, sampler,
                                               lengths=lengths)
        if not self.bonus_token:
            n_acc = n_acc.clamp(max=self.layout.levels - 1)
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
        """Pool the n-grams the window's columns spell, then shift the levels down and append the new one (while
        filling level by level, the new level goes above the ones written so far, nothing shifts)."""
        new = torch.tensor(new_level, dtype=torch.long)[None]
        self.window[0, 0] = x
        if self.model_levels < len(self.fill_shapes):
            self.window[self.model_levels + 1] = new[0]
            self.model_levels += 1
            return
        if self.model_levels >= self.layout.levels - 1:  # levels 1..N-2 are the model's own: real n-grams
            for column in torch.cat([self.window, new]).T.tolist():
                self.pool.add(column[0], tuple(column[1:]), from_window=True)
        self.window = torch.cat([self.window[1:], new])
        self.model_levels += 1
