"""One scored draft tree per step: paths from every source merged into a trie, each node with an estimated chance
of being accepted, and the b most likely nodes chosen for the model to verify.

A node is accepted when its parent is (x, the root, always is) and the model's choice after the parent is the
node's token. Each drafted token carries a calibration key (its source and a bucket, e.g. ("suffix", 5): a suffix
draft continuing a 5-token match); `Calibration` keeps, per key, the running fraction of tokens that were right
when their parent was, learnt from what every verification reveals. A node's chance is the product of its path's
conditional chances, so it never exceeds its parent's: the b most likely nodes (ties to the shallower) always
include their ancestors, and the expected number of accepted draft tokens of a chosen set is the sum of its nodes'
chances (siblings carry different tokens, so at most one of them is accepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

Key = tuple[str, Hashable]  # (source, bucket)


@dataclass(frozen=True)
class DraftPath:
    """Tokens proposed to follow the input token, with one calibration key per token."""

    tokens: tuple[int, ...]
    keys: tuple[Key, ...]


class Calibration:
    """Per calibration key, the decayed fraction of drafted tokens that were right when their parent was right.

    Starts from `priors[source]` (default `prior`) worth `prior_weight` observations; every observation fades
    older ones by `decay`, so the estimate follows the text.
    """

    def __init__(self, priors: dict[str, float] | None = None, prior: float = 0.3, prior_weight: float = 2.0,
                 decay: float = 0.995) -> None:
        self.priors, self.prior, self.prior_weight, self.decay = dict(priors or {}), prior, prior_weight, decay
        self._hits: dict[Key, float] = {}
        self._trials: dict[Key, float] = {}

    def chance(self, key: Key) -> float:
        if key not in self._trials:
            return self.priors.get(key[0], self.prior)
        return self._hits[key] / self._trials[key]

    def observe(self, key: Key, right: bool, weight: float = 1.0) -> None:
        if key not in self._trials:
            p = self.priors.get(key[0], self.prior)
            self._hits[key], self._trials[key] = p * self.prior_weight, self.prior_weight
        self._hits[key] = self.decay * self._hits[key] + weight * right
        self._trials[key] = self.decay * self._trials[key] + weight

    def learn(self, paths: Sequence[DraftPath], matches: Sequence[int], weight: float = 1.0) -> None:
        """Learn from one verification of `paths`: matches[j] leading tokens of path j equalled the model's
        choices. Token i of a path was tried with its parent right when i <= matches[j], and right when
        i < matches[j]; a node shared by several paths is counted once."""
        seen: set[tuple[int, ...]] = set()
        for path, m in zip(paths, matches):
            for i in range(min(m + 1, len(path.tokens))):
                prefix = path.tokens[:i + 1]
                if prefix not in seen:
                    seen.add(prefix)
                    self.observe(path.keys[i], i < m, weight)


@dataclass
class DraftTree:
    """Paths merged into a trie, with a score per node. Node i: tokens[i], parent[i] (-1: the root x), chance[i]
    (of being accepted), key[i] (the calibration key of the most confident source that proposed it). Nodes are
    numbered as masks.CandidateTree numbers a trie: path by path, token by token, new prefixes only."""

    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    chance: list[float] = field(default_factory=list)
    key: list[Key] = field(default_factory=list)

    @classmethod
    def merge(cls, paths: Sequence[DraftPath], calibration: Calibration, max_depth: int | None = None
              ) -> "DraftTree":
        """Paths (each cut to max_depth tokens) in order: a node's chance is the first path's through it, raised
        when a later path through it is more confident (its descendants keep theirs). Built in plain Python: it
        runs before every step, drafted or not, and a trie of a few dozen nodes is cheaper so than as tensors."""
        tree, node_of = cls(), {}  # (parent, token) -> node
        for path in paths:
            above, parent = 1.0, -1
            for token, key in zip(path.tokens[:max_depth], path.keys[:max_depth]):
                chance, node = above * calibration.chance(key), node_of.get((parent, token))
                if node is None:
                    node = node_of[parent, token] = len(tree.tokens)
                    tree.tokens.append(token)
                    tree.parent.append(parent)
                    tree.chance.append(chance)
                    tree.key.append(key)
                elif chance > tree.chance[node]:  # a more confident source: raise this node only
                    tree.chance[node], tree.key[node] = chance, key
                above, parent = tree.chance[node], node
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    def ranked(self) -> list[int]:
        """Nodes from the most to the least likely, the shallower first among equals. A node's chance never exceeds
        its parent's (chances are products of conditional chances <= 1, and raising a node does not raise its
        descendants), so every node comes after its ancestors and any prefix of this order is a tree."""
        depth = self.depths()
        return sorted(range(len(self)), key=lambda i: (-self.chance[i], depth[i], i))

    def depths(self) -> list[int]:
        depth: list[int] = []
        for p in self.parent:  # parents precede children
            depth.append(0 if p < 0 else depth[p] + 1)
        return depth

    def paths(self, nodes: Sequence[int]) -> list[DraftPath]:
        """The root-to-leaf paths of the sub-tree made of `nodes` (closed under ancestors), most likely leaf first."""
        chosen = set(nodes)
        inner = {self.parent[i] for i in chosen}
        leaves = sorted((i for i in chosen if i not in inner), key=lambda i: -self.chance[i])
        out = []
        for leaf in leaves:
            tokens, keys, i = [], [], leaf
            while i >= 0:
                tokens.append(self.tokens[i])
                keys.append(self.key[i])
                i = self.parent[i]
            out.append(DraftPath(tuple(reversed(tokens)), tuple(reversed(keys))))
        return out
