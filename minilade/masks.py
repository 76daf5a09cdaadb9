"""Geometry of one lookahead step: which row holds which token, at which rotary position, seeing which rows.

A step feeds the model T = (W + G) * (N - 1) tokens, in this row order:

    row:  0 | 1 ... W-1 | W ... 2W-1 | ... | (N-2)W ... (N-1)W-1 | candidate 0 | ... | candidate G-1
          x | level 0   | level 1    | ... | level N-2           | N-1 tokens each

x is the input token (the last emitted token, not yet in the cache); it doubles as column 0 of level 0.
Level l, column c sits at row l*W + c and rotary position p + l + c (p = x's position); candidate token i
sits at position p + 1 + i. With W = 4, N = 4, G = 2 (o = visible, . = hidden; every row also sees the
whole committed cache):

                 x  l0 l0 l0 | l1 l1 l1 l1 | l2 l2 l2 l2 | c0 c0 c0 | c1 c1 c1
    x            o           |             |             |          |
    level 0 c=2  o  o  o     |             |             |          |          level 0: causal
    level 1 c=2  o  o  o     |       o     |             |          |          column c of a later level:
    level 2 c=2  o  o  o     |       o     |       o     |          |          level 0 up to c, then its own column
    cand 0 i=1   o           |             |             | o  o     |          candidates: x and their own prefix
    cand 1 i=2   o           |             |             |          | o  o  o

Each window row therefore sees a chain of consecutive positions p, ..., p + l + c, as in a real sequence.
The two branches never see each other. Candidates are last, so a step with g < G candidates uses the
leading (W + g)(N - 1) rows and columns of the same template.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LookaheadLayout:
    window: int   # W, columns
    ngram: int    # N; the window keeps N - 1 levels, candidates are N - 1 tokens
    guesses: int  # G, the most candidates one step verifies

    def __post_init__(self) -> None:
        if self.ngram < 2:
            raise ValueError(f"ngram size N must be >= 2, got {self.ngram}")
        if self.window < 1:
            raise ValueError(f"window W must be >= 1, got {self.window}")
        if self.guesses < 0:
            raise ValueError(f"guesses G must be >= 0, got {self.guesses}")

    @property
    def levels(self) -> int:
        return self.ngram - 1

    @property
    def n_window_rows(self) -> int:
        """Rows of the lookahead branch, the input token included."""
        return self.levels * self.window

    def n_rows(self, n_candidates: int) -> int:
        return self.n_window_rows + n_candidates * self.levels

    @property
    def max_rows(self) -> int:
        return self.n_rows(self.guesses)

    @property
    def max_offset(self) -> int:
        """The largest position offset from the input token used by any row."""
        return max(self.levels + self.window - 2, self.levels if self.guesses else 0)

    def last_level_rows(self) -> torch.Tensor:
        """(W,) rows of the newest level; their outputs form the next level."""
        return torch.arange(self.window) + (self.levels - 1) * self.window

    def candidate_rows(self, n_candidates: int) -> torch.Tensor:
        """(g, N-1) row of each candidate token."""
        return torch.arange(n_candidates * self.levels).view(n_candidates, self.levels) + self.n_window_rows

    def step_rows(self, with_window: bool = True, cand_len: int | None = None) -> torch.Tensor:
        """Template rows one kind of step runs, in order: the window (or only x, for a step that just verifies),
        then the first cand_len tokens of each of the G candidates, candidate by candidate. A step with
        g < G candidates runs a prefix of these rows; its mask and positions are the template's, selected."""
        k = self.levels if cand_len is None else cand_len
        base = torch.arange(self.n_window_rows) if with_window else torch.zeros(1, dtype=torch.long)
        return torch.cat([base, self.candidate_rows(self.guesses)[:, :k].flatten()])

    def offsets(self) -> torch.Tensor:
        """(max_rows,) rotary position of each row, relative to the input token."""
        level = torch.arange(self.levels).repeat_interleave(self.window)
        column = torch.arange(self.window).repeat(self.levels)
        candidate = torch.arange(1, self.levels + 1).repeat(self.guesses)
        return torch.cat([level + column, candidate])

    def mask(self) -> torch.Tensor:
        """(max_rows, max_rows) bool, True where a row may attend to a row of the same step."""
        W, L, G = self.window, self.levels, self.guesses
        level = torch.arange(L).repeat_interleave(W)
        column = torch.arange(W).repeat(L)
        r_lvl, s_lvl = level[:, None], level[None, :]
        r_col, s_col = column[:, None], column[None, :]
        window = ((s_lvl == 0) & (s_col <= r_col)) | ((s_lvl >= 1) & (s_lvl <= r_lvl) & (s_col == r_col))

        cand = torch.arange(G).repeat_interleave(L)
        depth = torch.arange(L).repeat(G)
        guesses = (cand[:, None] == cand[None, :]) & (depth[None, :] <= depth[:, None])

        mask = torch.zeros(self.max_rows, self.max_rows, dtype=torch.bool)
        n = self.n_window_rows
        mask[:n, :n] = window
        mask[n:, n:] = guesses
        mask[n:, 0] = True  # candidates see the input token
        return mask
