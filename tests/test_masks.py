"""Geometry of a lookahead step: the window template, the candidate trie, and the two assembled."""

from __future__ import annotations

import pytest
import torch

from minilade.masks import CandidateTree, LookaheadLayout, StepShape


def render(mask: torch.Tensor) -> list[str]:
    return ["".join("o" if v else "." for v in row) for row in mask.tolist()]


def full_step(W: int, N: int, candidates: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole window step with these candidates (N - 1 tokens each): mask, position offsets, rows read."""
    shape = StepShape(LookaheadLayout(W, N, len(candidates)), with_window=True, device=torch.device("cpu"))
    return shape.assemble(CandidateTree.build(torch.tensor(candidates, dtype=torch.long).view(-1, N - 1)))


def test_mask_and_positions_literal() -> None:
    mask, offsets, read = full_step(3, 3, [[1, 2], [3, 4]])
    # rows: x, l0c1, l0c2 | l1c0, l1c1, l1c2 | cand0 (2 tokens) | cand1 (2 tokens)
    assert render(mask) == [
        "o.........",
        "oo........",
        "ooo.......",
        "o..o......",
        "oo..o.....",
        "ooo..o....",
        "o.....o...",
        "o.....oo..",
        "o.......o.",
        "o.......oo",
    ]
    assert offsets.tolist() == [0, 1, 2, 1, 2, 3, 1, 2, 1, 2]
    assert read.tolist() == [0, 3, 4, 5, 6, 7, 8, 9]  # x, the newest level, every candidate token
    assert LookaheadLayout(3, 3, 2).max_rows == (3 + 2) * (3 - 1)


def test_mask_n2_is_jacobi_window_plus_single_token_candidates() -> None:
    mask, offsets, read = full_step(3, 2, [[1], [2]])
    assert render(mask) == ["o....", "oo...", "ooo..", "o..o.", "o...o"]
    assert offsets.tolist() == [0, 1, 2, 1, 1]
    assert read.tolist() == [0, 1, 2, 3, 4]  # x is part of the newest (only) level


def test_a_verification_step_is_x_and_the_trie() -> None:
    shape = StepShape(LookaheadLayout(3, 4, 2), with_window=False, device=torch.device("cpu"))
    mask, offsets, read = shape.assemble(CandidateTree.build(torch.tensor([[1, 2], [1, 3]])))
    assert render(mask) == ["o...", "oo..", "ooo.", "oo.o"]
    assert offsets.tolist() == [0, 1, 2, 2] and read.tolist() == [0, 1, 2, 3]
    assert (shape.read, shape.level_logits, shape.node_logits_from) == ([0], slice(1, 1), 1)


@pytest.mark.parametrize("W,N,read,level", [(3, 2, [0, 1, 2], slice(0, 3)), (2, 3, [0, 2, 3], slice(1, 3)),
                                            (2, 4, [0, 4, 5], slice(1, 3))])
def test_the_rows_read_are_x_then_the_newest_level(W: int, N: int, read: list, level: slice) -> None:
    """x's logits are read once even when it is column 0 of the newest level (N = 2); the newest level's W
    rows follow it, then the trie's nodes."""
    shape = StepShape(LookaheadLayout(W, N, 1), with_window=True, device=torch.device("cpu"))
    assert (shape.read, shape.level_logits, shape.node_logits_from) == (read, level, len(read))
    assert LookaheadLayout(W, N, 1).last_level_rows().tolist() == read[level]


def test_window_rows_see_a_chain_of_consecutive_positions() -> None:
    """Every row sees exactly one row per position from x up to its own position: a well-formed sequence."""
    for W, N, G in [(1, 2, 0), (4, 5, 3), (7, 5, 7), (2, 3, 1)]:
        candidates = (torch.arange(G * (N - 1)).view(G, N - 1) + 1).tolist()
        mask, pos, _ = full_step(W, N, candidates)
        assert mask.shape[0] == LookaheadLayout(W, N, G).max_rows
        for row in range(mask.shape[0]):
            seen = sorted(pos[mask[row]].tolist())
            assert seen == list(range(int(pos[row]) + 1)), (W, N, G, row)


def test_candidates_sharing_a_prefix_share_rows() -> None:
    tree = CandidateTree.build(torch.tensor([[5, 6, 7], [5, 6, 8], [5, 9, 1], [2, 3, 4]]))
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4]  # 9 rows instead of 12
    assert tree.depth.tolist() == [0, 1, 2, 2, 1, 2, 0, 1, 2]
    assert tree.node_of.tolist() == [[0, 1, 2], [0, 1, 3], [0, 4, 5], [6, 7, 8]]
    assert render(tree.mask) == [
        "o........",
        "oo.......",
        "ooo......",
        "oo.o.....",  # 8 sees 5, 6 and itself, not its sibling 7
        "o...o....",
        "o...oo...",
        "......o..",
        "......oo.",
        "......ooo",
    ]


def test_ragged_candidates_share_prefixes_and_stop_at_their_ends() -> None:
    # [5 6 7], [5 6] (padded), [5 9 1 2], [3] (padded): lengths 3, 2, 4, 1.
    candidates = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0], [5, 9, 1, 2], [3, 0, 0, 0]])
    tree = CandidateTree.build(candidates, torch.tensor([3, 2, 4, 1]))
    assert tree.tokens.tolist() == [5, 6, 7, 9, 1, 2, 3]  # [5 6] is a prefix of [5 6 7]: no row of its own
    assert tree.depth.tolist() == [0, 1, 2, 1, 2, 3, 0]
    assert tree.node_of.tolist() == [[0, 1, 2, 2], [0, 1, 1, 1], [0, 3, 4, 5], [6, 6, 6, 6]]  # ends repeat
    assert render(tree.mask) == [
        "o......",
        "oo.....",
        "ooo....",
        "o..o...",
        "o..oo..",
        "o..ooo.",
        "......o",
    ]
    shape = StepShape(LookaheadLayout(2, 3, 4), with_window=False, device=torch.device("cpu"))
    _, offsets, _ = shape.assemble(tree)
    assert offsets.tolist() == [0, 1, 2, 3, 2, 3, 4, 1]  # a path's token i sits at x's position + 1 + i


def test_a_trie_of_paths_of_any_lengths() -> None:
    tree = CandidateTree.of([(1, 2, 3), (4,)])
    assert tree.lengths.tolist() == [3, 1] and tree.node_of.tolist() == [[0, 1, 2], [3, 3, 3]]
    assert (tree.n_paths, tree.path_length) == (2, 3)
    assert (CandidateTree.of([]).n_paths, CandidateTree.of([]).path_length, CandidateTree.of([]).size) == (0, 0, 0)
    tree = CandidateTree.of([torch.tensor([5, 6]), (5, 7)])  # a path's tokens as a tensor or as ints: one trie
    assert tree.tokens.tolist() == [5, 6, 7] and tree.node_of.tolist() == [[0, 1], [0, 2]]


def test_padding_never_makes_rows_even_when_it_equals_a_token() -> None:
    tree = CandidateTree.build(torch.tensor([[4, 4, 4], [4, 0, 0]]), torch.tensor([1, 1]))
    assert tree.tokens.tolist() == [4] and tree.node_of.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_candidate_lengths_out_of_range_are_refused() -> None:
    for lengths in ([0, 2], [1, 3]):
        try:
            CandidateTree.build(torch.tensor([[1, 2], [3, 4]]), torch.tensor(lengths))
        except ValueError as e:
            assert "lengths must be in 1..2" in str(e)
        else:
            raise AssertionError(f"lengths {lengths} accepted")
    with pytest.raises(ValueError, match="one token or more"):
        CandidateTree.of([(1, 2), ()])


def trie_by_loops(paths: list[list[int]]) -> tuple[list[int], list[int], list[list[bool]], list[list[int]]]:
    """CandidateTree written as loops: tokens, depths, mask and node_of of the trie of `paths`."""
    tokens, depth, parent, child, node_of = [], [], [], {}, []
    for path in paths:
        node, nodes = -1, []
        for token in path:
            if (node, token) not in child:
                child[(node, token)] = len(tokens)
                tokens.append(token)
                depth.append(len(nodes))
                parent.append(node)
            node = child[(node, token)]
            nodes.append(node)
        node_of.append(nodes + [nodes[-1]] * (max(map(len, paths)) - len(nodes)))
    mask = [[False] * len(tokens) for _ in tokens]
    for row in range(len(tokens)):
        node = row
        while node >= 0:  # a node sees itself and its ancestors
            mask[row][node] = True
            node = parent[node]
    return tokens, depth, mask, node_of


def test_the_trie_equals_its_loop_form() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        g, k, vocab = (int(torch.randint(1, n, (1,), generator=gen)) for n in (7, 6, 4))
        paths = [torch.randint(vocab, (int(torch.randint(1, k + 1, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(g)]
        tree = CandidateTree.of(paths)
        tokens, depth, mask, node_of = trie_by_loops(paths)
        assert tree.tokens.tolist() == tokens and tree.depth.tolist() == depth, paths
        assert tree.mask.tolist() == mask and tree.node_of.tolist() == node_of, paths
