"""The n-gram pool: most recent distinct continuations per key."""

from __future__ import annotations

from minilade.ngram_pool import NGramPool


def test_pool_keeps_most_recent_distinct_continuations() -> None:
    pool = NGramPool(ngram=3, capacity=2)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (2, 3))  # seen again: now the most recent, not a duplicate
    assert pool.candidates(1, 5) == [(2, 3), (4, 5)]
    pool.add(1, (6, 7))  # evicts the least recently seen, (4, 5)
    assert pool.candidates(1, 5) == [(6, 7), (2, 3)]
    assert pool.candidates(1, 1) == [(6, 7)]
    assert pool.candidates(9, 5) == []
    assert len(pool) == 2


def test_pool_add_ngrams_from_a_start_index() -> None:
    pool = NGramPool(ngram=3, capacity=4)
    pool.add_ngrams([1, 2, 3, 1, 2, 4])
    assert pool.candidates(1, 4) == [(2, 4), (2, 3)]
    assert pool.candidates(2, 4) == [(3, 1)]
    assert pool.candidates(3, 4) == [(1, 2)]
    pool = NGramPool(ngram=3, capacity=4)
    pool.add_ngrams([1, 2, 3, 1, 2, 4], start=2)
    assert pool.candidates(1, 4) == [(2, 4)] and pool.candidates(2, 4) == []
