"""Draft sources: where the paths a step verifies come from, each token with its calibration key; and the replay
that scores them on text whose continuation is known.

A DraftSource proposes paths to follow the text's last token (x) and may watch what the model computed at the rows
a step read. `auto` asks each of its sources every step and merges their paths into one scored tree (tree.py).

Keys (source, bucket) say what a token's chance of being right depends on:
- ("suffix", (m, branch)): a suffix draft's token that continues an m-token match (m = key length + tokens drafted
  before it, capped at MAX_MATCH); branch is False for the most recent occurrence of the longest match;
- ("history", (m, branch)): the same for a draft from earlier answers (history.py);
- ("pool", depth) / ("window", depth): a pool candidate's token at that depth, from an n-gram the text contained or
  one only the lookahead window produced.
`replay_calibration` runs the same sources over text whose continuation is known (the prompt), so the estimates
start from how predictable this text is rather than from a guess.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..ngram_pool import NGramPool
from ..verify import common_prefix
from .history import DraftHistory
from .recycle import RecycleTable
from .suffix import SuffixIndex
from .tree import Calibration, DraftPath

MAX_MATCH = 12  # matches at least this long share one calibration bucket


def suffix_paths(index: SuffixIndex, tokens: Sequence[int], length: int, branches: int) -> list[DraftPath]:
    """The suffix index's drafts for the text `tokens`, as keyed paths."""
    out = []
    for d in index.drafts(tokens, length, branches):
        keys = tuple(("suffix", (min(d.match + i, MAX_MATCH), d.rank > 0)) for i in range(len(d.tokens)))
        out.append(DraftPath(d.tokens, keys))
    return out


def history_paths(history: DraftHistory, tokens: Sequence[int], length: int, branches: int) -> list[DraftPath]:
    """The history's drafts (earlier answers) for the text `tokens`, as keyed paths ("history", (m, branch))."""
    return [DraftPath(d.tokens, tuple(("history", (min(d.match + i, MAX_MATCH), d.rank > 0))
                                      for i in range(len(d.tokens))))
            for d in history.drafts(tokens, length, branches)]


def pool_paths(pool: NGramPool, key: int, limit: int) -> list[DraftPath]:
    """Up to `limit` pool continuations of `key`, as keyed paths."""
    out = []
    for cont in pool.candidates(key, limit):
        source = "window" if pool.from_window(key, cont) else "pool"
        out.append(DraftPath(cont, tuple((source, i) for i in range(len(cont)))))
    return out


class DraftSource:
    """Proposes draft paths for a growing text. paths(text, room): paths to follow text[-1], none longer than room
    tokens (positions past the context's end). observe(tokens, logits): the tokens a step fed at the rows it read
    (R,) and their logits (R, V); most sources ignore it."""

    def paths(self, text: Sequence[int], room: int) -> list[DraftPath]:
        raise NotImplementedError

    def observe(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        pass


class SuffixDrafts(DraftSource):
    """Up to `branches` copies of what followed earlier occurrences of the text's ending (suffix.py), each at
    most `length` tokens."""

    def __init__(self, index: SuffixIndex, length: int, branches: int) -> None:
        self.index, self.length, self.branches = index, length, branches

    def paths(self, text: Sequence[int], room: int) -> list[DraftPath]:
        return suffix_paths(self.index, text, min(self.length, room), self.branches)


class HistoryDrafts(DraftSource):
    """The same from the model's answers to earlier prompts (history.py)."""

    def __init__(self, history: DraftHistory, length: int, branches: int) -> None:
        self.history, self.length, self.branches = history, length, branches

    def paths(self, text: Sequence[int], room: int) -> list[DraftPath]:
        return history_paths(self.history, text, min(self.length, room), self.branches)


class PoolDrafts(DraftSource):
    """Up to `limit` continuations of x from an n-gram pool (filled by its owner: the text's and the lookahead
    window's n-grams)."""

    def __init__(self, pool: NGramPool, limit: int) -> None:
        self.pool, self.limit = pool, limit

    def paths(self, text: Sequence[int], room: int) -> list[DraftPath]:
        return pool_paths(self.pool, text[-1], self.limit)


class RecycledDrafts(DraftSource):
    """A tree from the model's own top-k next tokens after every token it read (recycle.py): widths[d] children
    per node at depth d (None: all k)."""

    def __init__(self, table: RecycleTable, widths: Sequence[int | None]) -> None:
        self.table, self.widths = table, tuple(w or table.k for w in widths)

    def paths(self, text: Sequence[int], room: int) -> list[DraftPath]:
        return self.table.paths(text[-1], self.widths[:room])

    def observe(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        self.table.update(tokens, logits)


def leading_matches(paths: Sequence[DraftPath], truth: Sequence[int]) -> list[int]:
    """Per path, how many of its first tokens equal the text that really followed."""
    return [common_prefix(p.tokens, truth) for p in paths]


PathMaker = Callable[[Sequence[int]], list[DraftPath]]


def replay_calibration(calibration: Calibration, tokens: Sequence[int], start: int, paths_for: PathMaker,
                       weight: float = 0.25) -> int:
    """Teach `calibration` what the drafts for every prefix tokens[:j + 1], j >= start, got right about the
    tokens that follow it. paths_for sees the prefixes in increasing order (a suffix index may grow with them).
    Returns how many prefixes had drafts."""
    drafted = 0
    for j in range(start, len(tokens) - 1):
        paths = paths_for(tokens[:j + 1])
        if paths:
            drafted += 1
            truth = tokens[j + 1:j + 1 + max(len(p.tokens) for p in paths)]
            calibration.learn(paths, leading_matches(paths, truth), weight)
    return drafted


def text_sources(ngram: int, guesses: int, suffix_draft: int, suffix_branches: int,
                 index: SuffixIndex | None = None) -> PathMaker:
    """Drafts that depend on the text alone (suffix drafts, then the pool of the text's n-grams), for replaying over
    text whose continuation is known; the pool and index grow with the prefixes they are shown."""
    index = index if index is not None else SuffixIndex()
    pool = NGramPool(ngram, max(guesses, 1))

    def paths_for(prefix: Sequence[int]) -> list[DraftPath]:
        pool.add_text(prefix)
        out = suffix_paths(index, prefix, suffix_draft, suffix_branches) if suffix_draft else []
        return out + (pool_paths(pool, prefix[-1], guesses) if guesses else [])

    return paths_for
