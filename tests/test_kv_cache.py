"""Rollback and compaction leave the cache exactly as if the kept tokens had been fed one by one."""

from __future__ import annotations

import pytest
import torch

from minilade.masks import CandidateTree, LookaheadLayout, StepShape

from .helpers import tiny_model


def filled_token_by_token(model, tokens: list[int]):
    cache = model.new_cache(64)
    for pos, tok in enumerate(tokens):
        model(torch.tensor([[tok]]), torch.tensor([pos]), cache)
        cache.commit(1)
    return cache


def assert_same_prefix(a, b, n: int) -> None:
    assert a.length == b.length == n
    torch.testing.assert_close(a.k[:, :, :, :n], b.k[:, :, :, :n], rtol=0, atol=1e-12)
    torch.testing.assert_close(a.v[:, :, :, :n], b.v[:, :, :, :n], rtol=0, atol=1e-12)


def test_truncate_then_refill_equals_token_by_token() -> None:
    model = tiny_model(vocab=40, dtype=torch.float64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        cache = model.new_cache(64)
        model(torch.tensor([prompt + [7, 7, 7]]), torch.arange(11), cache)
        cache.commit(11)
        cache.truncate(8)  # roll the three 7s back
        model(torch.tensor([[8, 3]]), torch.tensor([8, 9]), cache)
        cache.commit(2)
        assert_same_prefix(cache, filled_token_by_token(model, prompt + [8, 3]), 10)


def test_compact_accepted_candidate_equals_token_by_token() -> None:
    """A lookahead step whose second candidate is accepted for two tokens: its K/V rows move into place."""
    model = tiny_model(vocab=40, dtype=torch.float64)
    prompt = [5, 6, 7, 8, 9]
    layout = LookaheadLayout(window=3, ngram=3, guesses=2)
    window = [9, 11, 12, 13, 14, 15]  # input token 9 followed by the rest of a 2 x 3 window
    candidates = [[20, 21], [30, 31]]
    with torch.no_grad():
        cache = model.new_cache(64)
        model(torch.tensor([prompt[:-1]]), torch.arange(4), cache)
        cache.commit(4)
        tree = CandidateTree.build(torch.tensor(candidates))
        mask, offsets, _ = StepShape(layout, with_window=True, device=torch.device("cpu")).assemble(tree)
        model(torch.tensor([window + tree.tokens.tolist()]), 4 + offsets, cache, mask)
        accepted = tree.node_of[1, :2] + layout.n_window_rows
        cache.compact(torch.cat([torch.zeros(1, dtype=torch.long), accepted]))
        assert_same_prefix(cache, filled_token_by_token(model, prompt + [30, 31]), 7)


def test_compact_rejects_overflow() -> None:
    model = tiny_model(vocab=40)
    cache = model.new_cache(4)
    cache.commit(3)
    with pytest.raises(ValueError, match=r"3 committed \+ 2 new tokens > capacity 4"):
        cache.compact(torch.tensor([0, 1]))
