"""Token recycling (arXiv 2408.08696): the model's own top-k next tokens after every token it was fed, kept as a
(V, k) table, drafted from as a tree.

Every step reads logits for some of the rows it fed (x, the window's newest level, every draft node); the k most
likely next tokens after each such row's token overwrite that token's entry. The table then proposes, for the
input token, its k recorded successors, each followed by its own recorded successors, and so on: a tree whose
shape (how many children at each depth) is fixed. Entries are what followed the token in some earlier context, not
this one, so they are drafts only; verification decides.

Memory: exactly V * k int32 on the device (`nbytes`), whatever the text's length. Rows of tokens never fed hold -1.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .tree import DraftPath


class RecycleTable:
    def __init__(self, vocab_size: int, k: int, device: torch.device | str = "cpu") -> None:
        if k < 1:
            raise ValueError(f"recycled top-k must be >= 1, got {k}")
        self.k = k
        self.table = torch.full((vocab_size, k), -1, dtype=torch.int32, device=device)  # (V, k)

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """tokens: (R,) the tokens fed at the rows whose logits (R, V) were read. Later rows win for a token fed
        twice (index_copy_ keeps the last write on the CPU; elsewhere some write, which only changes drafts)."""
        top = logits.topk(self.k, dim=-1).indices.to(torch.int32)  # (R, k)
        self.table.index_copy_(0, tokens.to(self.table.device), top)

    def paths(self, x: int, widths: Sequence[int]) -> list[DraftPath]:
        """Root-to-leaf paths of the tree below x: widths[d] children per node at depth d (each <= k), from the
        table; a node whose token was never fed ends its branch. Keys ("recycle", (depth, rank))."""
        if not widths:
            return []
        frontier = torch.tensor([x], device=self.table.device)
        levels = []  # per depth: (nodes,) tokens, in breadth-first order
        for w in widths:
            frontier = self.table[frontier.long(), :min(w, self.k)].reshape(-1)
            levels.append(frontier)
        host = [level.tolist() for level in levels]
        return tree_paths(host, widths)


def tree_paths(levels: list[list[int]], widths: Sequence[int]) -> list[DraftPath]:
    """Root-to-leaf paths of a breadth-first tree: node i of levels[d + 1] is child i % w of node i // w of
    levels[d], w = len(levels[d + 1]) // len(levels[d]); -1 marks no token (its subtree is dropped). A node's key
    is ("recycle", (depth, its rank among its siblings))."""
    out: list[DraftPath] = []

    def walk(depth: int, index: int, tokens: tuple[int, ...], keys: tuple) -> bool:
        token = levels[depth][index]
        if token < 0:
            return False
        width = len(levels[depth]) // (len(levels[depth - 1]) if depth else 1)
        tokens, keys = tokens + (token,), keys + (("recycle", (depth, index % width)),)
        has_child = False
        if depth + 1 < len(levels):
            w = len(levels[depth + 1]) // len(levels[depth])
            for child in range(w):
                has_child |= walk(depth + 1, index * w + child, tokens, keys)
        if not has_child:
            out.append(DraftPath(tokens, keys))
        return True

    for first in range(len(levels[0])):
        walk(0, first, (), ())
    return out
