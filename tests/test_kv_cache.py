"""Rollback and compaction leave the cache exactly as if the kept tokens had been fed one by one; large caches live
in huge pages."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from minilade.kv_cache import HUGE_PAGE, huge_page_zeros
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


ADVISES_HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")


def test_huge_page_buffers_are_zeroed_aligned_and_keep_their_memory() -> None:
    big = huge_page_zeros((4, HUGE_PAGE // 4), torch.float32)  # 8 MiB
    assert big.shape == (4, HUGE_PAGE // 4) and big.dtype == torch.float32 and not big.any()
    if ADVISES_HUGE_PAGES:
        assert big.data_ptr() % HUGE_PAGE == 0
    big[3, -1], big[0, 0] = 2.5, -1.0
    gc.collect()  # nothing but the tensor holds the mapping
    assert big[3, -1] == 2.5 and big[0, 0] == -1.0 and big.sum() == 1.5
    small = huge_page_zeros((3, 5), torch.float16)  # under a huge page: torch's own memory
    assert small.shape == (3, 5) and small.dtype == torch.float16 and not small.any()


@pytest.mark.skipif(not ADVISES_HUGE_PAGES, reason="no madvise(MADV_HUGEPAGE) here")
def test_a_kernel_that_refuses_the_advice_leaves_the_buffer_in_small_pages(monkeypatch) -> None:
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)  # advice no kernel knows: madvise fails with EINVAL
    buffer = huge_page_zeros((HUGE_PAGE // 4,), torch.float32)
    buffer[-1] = 3.0
    assert buffer.sum() == 3.0


def test_a_cache_in_huge_pages_holds_what_a_small_one_does() -> None:
    model = tiny_model(vocab=40, dtype=torch.float64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        cache = model.new_cache(8192)
        assert cache.k.numel() * cache.k.element_size() >= HUGE_PAGE
        if ADVISES_HUGE_PAGES:
            assert cache.k.data_ptr() % HUGE_PAGE == 0 and cache.v.data_ptr() % HUGE_PAGE == 0
        model(torch.tensor([prompt + [7, 7]]), torch.arange(10), cache)
        cache.commit(10)
        cache.truncate(8)
        model(torch.tensor([[8, 3]]), torch.tensor([8, 9]), cache)
        cache.commit(2)
        assert_same_prefix(cache, filled_token_by_token(model, prompt + [8, 3]), 10)
