"""Token recycling: the (V, k) table of the model's top-k next tokens, its memory bound and the trees it drafts."""

from __future__ import annotations

import pytest
import torch

from minilade.drafts.recycle import RecycleTable, tree_paths


def logits_ranking(vocab: int, *ranked: int) -> torch.Tensor:
    """Logits (V,) whose top tokens are `ranked`, in that order."""
    out = torch.zeros(vocab)
    out[list(ranked)] = torch.arange(len(ranked), 0, -1, dtype=torch.float32)
    return out


def test_table_keeps_the_latest_top_k_of_every_token_read() -> None:
    table = RecycleTable(vocab_size=10, k=2)
    assert table.nbytes == 10 * 2 * 4  # V x k int32, whatever the text's length
    table.update(torch.tensor([1, 4]), torch.stack([logits_ranking(10, 4, 5), logits_ranking(10, 7, 8)]))
    table.update(torch.tensor([1]), logits_ranking(10, 2, 3)[None])  # 1 read again: its entry is replaced
    assert table.table[[1, 4, 0]].tolist() == [[2, 3], [7, 8], [-1, -1]]


def test_tree_from_the_table_drops_branches_of_unknown_tokens() -> None:
    table = RecycleTable(vocab_size=10, k=2)
    table.update(torch.tensor([1, 4, 5]), torch.stack([logits_ranking(10, 4, 5), logits_ranking(10, 7, 8),
                                                       logits_ranking(10, 9, 1)]))
    paths = table.paths(1, (2, 2))
    assert [p.tokens for p in paths] == [(4, 7), (4, 8), (5, 9), (5, 1)]
    assert paths[1].keys == (("recycle", (0, 0)), ("recycle", (1, 1)))
    assert [p.tokens for p in table.paths(4, (2, 1))] == [(7,), (8,)]  # 7 and 8 were never read: leaves
    assert table.paths(0, (2,)) == []


def test_tree_paths_of_a_breadth_first_layout() -> None:
    paths = tree_paths([[3, 4], [5, -1, 6, 7]], (2, 2))
    assert [p.tokens for p in paths] == [(3, 5), (4, 6), (4, 7)]


def test_bad_k_is_refused() -> None:
    with pytest.raises(ValueError, match="top-k must be >= 1"):
        RecycleTable(10, 0)
