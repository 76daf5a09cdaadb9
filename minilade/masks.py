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
The two branches never see each other.

Candidates that share a prefix need not be computed twice: a step lays them out as a trie (CandidateTree),
one row per distinct prefix, each row seeing x and its own ancestors; with no shared prefix the trie block is
exactly the candidate block above. The window part (LookaheadLayout) is fixed per (W, N) and built once, as is
the base of each kind of step (StepShape: the whole window, or x alone for a step that only verifies); the trie
depends on the step's candidates and is built for each step by a few tensor operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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

    @property
    def max_rows(self) -> int:
        """Rows of the largest step: the window and G candidates that share no prefix."""
        return self.n_window_rows + self.guesses * self.levels

    @property
    def max_offset(self) -> int:
        """The largest position offset from the input token used by any row."""
        return max(self.levels + self.window - 2, self.levels if self.guesses else 0)

    def last_level_rows(self) -> torch.Tensor:
        """(W,) rows of the newest level; their outputs form the next level."""
        return torch.arange(self.window) + (self.levels - 1) * self.window

    def window_offsets(self) -> torch.Tensor:
        """(W * (N-1),) rotary position of each window row, relative to the input token."""
        level = torch.arange(self.levels).repeat_interleave(self.window)
        column = torch.arange(self.window).repeat(self.levels)
        return level + column

    def window_mask(self) -> torch.Tensor:
        """(W * (N-1), W * (N-1)) bool, True where a window row may attend to another: level 0 causally, a later
        level's column c to level 0 up to c and to its own column's earlier levels."""
        level = torch.arange(self.levels).repeat_interleave(self.window)
        column = torch.arange(self.window).repeat(self.levels)
        r_lvl, s_lvl = level[:, None], level[None, :]
        r_col, s_col = column[:, None], column[None, :]
        return ((s_lvl == 0) & (s_col <= r_col)) | ((s_lvl >= 1) & (s_lvl <= r_lvl) & (s_col == r_col))


@dataclass(frozen=True)
class CandidateTree:
    """g candidates of up to k tokens laid out as a trie: one node (row) per distinct prefix.

    Candidates may differ in length (ragged): candidate j is its first lengths[j] >= 1 tokens; the rest of its row
    in the padded (g, k) tensor is ignored. Nodes are numbered candidate by candidate, token by token, skipping
    prefixes an earlier candidate already has.
    tokens, depth: (n,) each node's token and its depth (its position is x's + 1 + depth).
    mask: (n, n) bool, a node sees its ancestors and itself.
    node_of: (g, k) the node of candidate j's token i; past a candidate's end, the node of its last token (so
    gathers stay in range; verification never reads past lengths[j]). lengths: (g,) tokens per candidate.

        candidates [5 6 7], [5 6 .], [5 9 1] (lengths 3, 2, 3)  ->  nodes 5 6 7 9 1, depths 0 1 2 1 2
        node_of [[0 1 2], [0 1 1], [0 3 4]]
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    node_of: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def build(cls, candidates: torch.Tensor, lengths: torch.Tensor | None = None) -> "CandidateTree":
        g, k = candidates.shape
        lengths = torch.full((g,), k, dtype=torch.long) if lengths is None else lengths.long()
        if g == 0:
            empty = torch.zeros(0, dtype=torch.long)
            return cls(empty, empty, torch.zeros(0, 0, dtype=torch.bool), torch.zeros(0, k, dtype=torch.long), empty)
        if int(lengths.min()) < 1 or int(lengths.max()) > k:
            raise ValueError(f"candidate lengths must be in 1..{k}, got {lengths.tolist()}")
        inside = torch.arange(k) < lengths[:, None]  # (g, k): real tokens, not padding
        padded = torch.where(inside, candidates, -1)  # padding never equals a token
        same_prefix = (padded[:, None, :] == padded[None, :, :]).int().cumprod(dim=2)  # (g, g, k)
        owner = same_prefix.argmax(dim=1)  # (g, k): the first candidate with the same prefix up to token i
        is_node = (owner == torch.arange(g)[:, None]) & inside
        flat_nodes = is_node.flatten().nonzero().squeeze(1)  # owner * k + i, in node order
        number = torch.full((g * k,), -1, dtype=torch.long)
        number[flat_nodes] = torch.arange(flat_nodes.numel())
        node_of = number[owner * k + torch.arange(k)]  # (g, k); -1 past a candidate's end
        last = node_of.gather(1, (lengths - 1)[:, None])  # (g, 1)
        node_of = torch.where(inside, node_of, last)
        depth = flat_nodes % k
        ancestors = node_of[flat_nodes // k]  # (n, k): each node's ancestor at every depth (its own candidate's)
        n = flat_nodes.numel()
        mask = (depth[None, :] <= depth[:, None]) & (ancestors.gather(1, depth.expand(n, n)) == torch.arange(n))
        return cls(candidates.flatten()[flat_nodes], depth, mask, node_of, lengths)

    @classmethod
    def of(cls, paths: Sequence[Sequence[int]]) -> "CandidateTree":
        """The trie of paths (each one token or more, of any lengths)."""
        k = max((len(p) for p in paths), default=1)
        padded = torch.zeros(len(paths), k, dtype=torch.long)
        for j, path in enumerate(paths):
            padded[j, :len(path)] = torch.tensor(path, dtype=torch.long)
        return cls.build(padded, torch.tensor([len(p) for p in paths], dtype=torch.long))

    @property
    def n_paths(self) -> int:
        return self.node_of.shape[0]

    @property
    def path_length(self) -> int:
        """k, the longest path's tokens (0 without paths)."""
        return self.node_of.shape[1] if self.n_paths else 0

    @property
    def size(self) -> int:
        return self.tokens.numel()


class StepShape:
    """The fixed base of one kind of step, on the device: the whole window, or x alone (a step that only verifies).

    A step feeds these n_base rows, then its candidates' trie (CandidateTree). `read` lists the rows whose
    logits are needed, in this order: x (row 0; when N = 2 it is also column 0 of the newest level, and read once),
    then the newest level's W rows, then every trie node. In the logits of the `read` rows, x's are row 0, the
    newest level's are `level_logits`, and the nodes' start at `node_logits_from`.
    """

    def __init__(self, layout: LookaheadLayout, with_window: bool, device: torch.device) -> None:
        self.with_window, self.device = with_window, device
        if with_window:
            self.mask = layout.window_mask().to(device)
            self.offsets = layout.window_offsets().to(device)
            newest = layout.last_level_rows().tolist()
        else:
            self.mask = torch.ones(1, 1, dtype=torch.bool, device=device)
            self.offsets = torch.zeros(1, dtype=torch.long, device=device)
            newest = []
        self.n_base = self.offsets.numel()
        self.read = ([] if 0 in newest else [0]) + newest
        self.node_logits_from = len(self.read)
        self.level_logits = slice(self.node_logits_from - len(newest), self.node_logits_from)

    def assemble(self, tree: CandidateTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mask (T, T), position offsets from x (T,) and rows to read, for this base followed by the trie's nodes."""
        n, T = self.n_base, self.n_base + tree.size
        mask = torch.zeros(T, T, dtype=torch.bool, device=self.device)
        mask[:n, :n] = self.mask
        mask[n:, 0] = True  # every candidate token sees x
        mask[n:, n:] = tree.mask.to(self.device)
        offsets = torch.cat([self.offsets, (tree.depth + 1).to(self.device)])
        read = torch.cat([torch.tensor(self.read), torch.arange(n, T)]).to(self.device)
        return mask, offsets, read


def interleaved_step(past: int, T: int, lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (T,) and mask (T, T) of a lookahead-shaped step: row r is in lane r % lanes, the input token
    (row 0) opens lane 0; each lane is a chain of consecutive positions seeing row 0 and its own earlier rows, so
    every row's visible rows are interleaved with rows it must not see."""
    r = torch.arange(T)
    lane, index = r % lanes, r // lanes
    positions = past + index + (lane > 0).long()
    mask = (lane[:, None] == lane[None, :]) & (index[None, :] <= index[:, None])
    mask[:, 0] = True
    return positions, mask
