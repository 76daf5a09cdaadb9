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

import numpy as np
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
        """The trie of g padded candidates (g, k), candidate j being its first lengths[j] tokens (all k without
        lengths); node_of keeps the padded width k."""
        g, k = candidates.shape
        lengths = torch.full((g,), k, dtype=torch.long) if lengths is None else lengths.long()
        if g and (int(lengths.min()) < 1 or int(lengths.max()) > k):
            raise ValueError(f"candidate lengths must be in 1..{k}, got {lengths.tolist()}")
        tree = cls.of([row[:n] for row, n in zip(candidates.tolist(), lengths.tolist())])
        node_of = tree.node_of if g else torch.zeros(0, k, dtype=torch.long)
        node_of = torch.cat([node_of, node_of[:, -1:].expand(g, k - node_of.shape[1])], dim=1)
        return cls(tree.tokens, tree.depth, tree.mask, node_of, tree.lengths)

    @classmethod
    def of(cls, paths: Sequence[Sequence[int]]) -> "CandidateTree":
        """The trie of paths (each one token or more, of any lengths), built on the host: a drafted step's trie has
        a few dozen nodes at most, and loops over them cost less than tensor operations (auto's drafted steps on
        HumanEval, the demo model: 0.05 ms a trie against 0.32 built by some twenty tensor operations)."""
        node_at: dict[tuple[int, int], int] = {}  # (parent node or -1, token) -> node
        tokens: list[int] = []
        depth: list[int] = []
        parent: list[int] = []
        node_of: list[list[int]] = []
        for path in paths:
            if not len(path):
                raise ValueError("every path of a trie has one token or more")
            node, nodes = -1, []
            for token in map(int, path):  # ints, so that equal tokens share a node whatever held them
                child = node_at.get((node, token))
                if child is None:
                    child = node_at[(node, token)] = len(tokens)
                    tokens.append(token)
                    depth.append(len(nodes))
                    parent.append(node)
                node = child
                nodes.append(node)
            node_of.append(nodes)
        k = max(map(len, node_of), default=1)
        n = len(tokens)
        mask = np.zeros((n, n), dtype=bool)
        for row in range(n):  # a node sees its parent's ancestors, its parent and itself (parents come first)
            if parent[row] >= 0:
                mask[row] = mask[parent[row]]
            mask[row, row] = True
        padded = [nodes + nodes[-1:] * (k - len(nodes)) for nodes in node_of]  # past its end, a path's last node
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(depth, dtype=torch.long),
                   torch.from_numpy(mask), torch.tensor(padded, dtype=torch.long).view(len(paths), k),
                   torch.tensor([len(nodes) for nodes in node_of], dtype=torch.long))

    def paths(self) -> list[list[int]]:
        """The candidates' tokens, each its own length."""
        return [row[:n] for row, n in zip(self.tokens[self.node_of].tolist(), self.lengths.tolist())]

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
    """The fixed base of one kind of step: the whole window, or x alone (a step that only verifies).

    A step feeds these n_base rows, then its candidates' trie (CandidateTree). `read` lists the rows whose
    logits are needed, in this order: x (row 0; when N = 2 it is also column 0 of the newest level, and read once),
    then the newest level's W rows, then every trie node. In the logits of the `read` rows, x's are row 0, the
    newest level's are `level_logits`, and the nodes' start at `node_logits_from`. A step's mask, offsets and
    rows to read are laid out on the host (a few small arrays, in numpy) and handed to the device once.
    """

    def __init__(self, layout: LookaheadLayout, with_window: bool, device: torch.device) -> None:
        self.with_window, self.device = with_window, device
        if with_window:
            self.mask = layout.window_mask().numpy()
            self.offsets = layout.window_offsets().numpy()
            newest = layout.last_level_rows().tolist()
        else:
            self.mask = np.ones((1, 1), dtype=bool)
            self.offsets = np.zeros(1, dtype=np.int64)
            newest = []
        self.n_base = self.offsets.size
        self.read = ([] if 0 in newest else [0]) + newest
        self.node_logits_from = len(self.read)
        self.level_logits = slice(self.node_logits_from - len(newest), self.node_logits_from)

    def assemble(self, tree: CandidateTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mask (T, T), position offsets from x (T,) and rows to read, for this base followed by the trie's nodes,
        on the device."""
        n, T = self.n_base, self.n_base + tree.size
        mask = np.zeros((T, T), dtype=bool)
        mask[:n, :n] = self.mask
        mask[n:, 0] = True  # every candidate token sees x
        mask[n:, n:] = tree.mask.numpy()
        offsets = np.concatenate([self.offsets, tree.depth.numpy() + 1])
        read = np.concatenate([np.array(self.read, dtype=np.int64), np.arange(n, T)])
        return (torch.from_numpy(mask).to(self.device), torch.from_numpy(offsets).to(self.device),
                torch.from_numpy(read).to(self.device))


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
