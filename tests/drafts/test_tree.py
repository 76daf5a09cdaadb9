"""The scored draft tree: paths merged, chances from calibration, nodes ranked ancestors first."""

from __future__ import annotations

import random

import pytest

from minilade.drafts.tree import Calibration, DraftPath, DraftTree
from minilade.masks import CandidateTree


def path(tokens, source="s"):
    return DraftPath(tuple(tokens), tuple((source, i) for i in range(len(tokens))))


def test_paths_merge_into_a_trie_with_chances_multiplied_along_them() -> None:
    cal = Calibration(priors={"s": 0.5, "t": 0.9})
    tree = DraftTree.merge([path([1, 2, 3]), path([1, 4]), path([1, 2], source="t")], cal)
    assert tree.tokens == [1, 2, 3, 4] and tree.parent == [-1, 0, 1, 0]
    # [1 2] from t is more confident (0.9, 0.81): it raises nodes 1 and 2's chance, not node 3's (its descendant).
    assert tree.chance == pytest.approx([0.9, 0.81, 0.125, 0.25])
    assert tree.ranked() == [0, 1, 3, 2]
    assert [p.tokens for p in tree.paths([0, 1, 3])] == [(1, 2), (1, 4)]  # leaves, most likely first


def test_the_tree_is_numbered_as_the_verified_trie_is() -> None:
    """The draft tree's nodes are those of masks.CandidateTree over the same paths, in its order, cut to max_depth:
    random paths sharing many prefixes."""
    rng = random.Random(0)
    for _ in range(200):
        paths = [path([rng.randrange(3) for _ in range(rng.randrange(1, 6))]) for _ in range(rng.randrange(1, 8))]
        tree = DraftTree.merge(paths, Calibration(), max_depth=4)
        trie = CandidateTree.of([p.tokens[:4] for p in paths])
        assert tree.tokens == trie.tokens.tolist()
        depth = tree.depths()
        assert depth == trie.depth.tolist()
        for i, parent in enumerate(tree.parent):  # a node's parent is the node it sees at the depth above
            assert parent == -1 or (trie.mask[i, parent] and depth[parent] == depth[i] - 1)


def test_ranking_never_puts_a_node_before_its_parent() -> None:
    cal = Calibration(priors={"s": 1.0})  # every chance 1: ties, broken by depth
    tree = DraftTree.merge([path([1, 2, 3, 4]), path([5, 6])], cal)
    order = tree.ranked()
    for i, node in enumerate(order):
        assert tree.parent[node] == -1 or tree.parent[node] in order[:i]


def test_calibration_learns_only_from_tokens_whose_parent_was_right() -> None:
    cal = Calibration(prior=0.5, prior_weight=1.0, decay=1.0)
    paths = [DraftPath((1, 2, 3), (("s", 0), ("s", 1), ("s", 2))), DraftPath((1, 5), (("s", 0), ("s", 1)))]
    cal.learn(paths, [1, 2])  # path 0: 1 right, 2 wrong; path 1: 1 and 5 right (node 1 counted once)
    assert cal.chance(("s", 0)) == pytest.approx((0.5 + 1) / 2)
    assert cal.chance(("s", 1)) == pytest.approx((0.5 + 0 + 1) / 3)  # token 2 wrong, token 5 right
    assert cal.chance(("s", 2)) == pytest.approx(0.5)  # token 3's parent was wrong: nothing learnt
