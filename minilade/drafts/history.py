"""Drafts across requests: what followed the text's ending in the model's answers to earlier prompts.

A model that answers many similar requests repeats itself from one answer to the next ("This function takes a
list of ... and returns ..."). The text of one request cannot draft that at its start; its predecessors can. The
history keeps the new tokens of finished generations (the caller adds them: AutoDecoder.finish), joined by
SEPARATOR, under one SuffixIndex, and drafts for a text what followed the latest occurrences of the text's longest
ending that occurs there, up to the end of that answer. It is the global suffix tree of SuffixDecoding (arXiv
2411.04975) and llama.cpp lookup's dynamic n-gram cache, as an index of latest occurrences.

Memory: at most `capacity` tokens (past it, the oldest answers are dropped down to 3/4 of it and the index is
rebuilt), so at most max_key * capacity keys holding `keep` positions each. `frozen` stops it from growing
(benchmarks seed it, then freeze it, so a measured prompt never drafts from an earlier run of itself).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Sequence

from .suffix import SEPARATOR, SuffixDraft, SuffixIndex


class DraftHistory:
    """capacity: tokens kept (the default, 16,384, is some 128 answers of 128 tokens; about 25 MB of index in
    CPython, measured); max_key, keep: as for SuffixIndex."""

    def __init__(self, capacity: int = 1 << 14, max_key: int = 8, keep: int = 4) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"history capacity must be a whole number of tokens >= 1, got {capacity!r}")
        self.capacity, self.max_key, self.keep = capacity, max_key, keep
        self.frozen = False
        self._lock = threading.Lock()  # generations in several threads (a server's) may share one history
        self._answers: deque[list[int]] = deque()
        self._held = 0
        self._rebuild()

    def __len__(self) -> int:
        """Tokens held (separators not counted)."""
        return self._held

    def add(self, tokens: Sequence[int]) -> None:
        """Keep one generation's new tokens (unless frozen); the oldest answers go when over capacity."""
        answer = list(tokens)[-self.capacity:]
        if self.frozen or not answer:
            return
        with self._lock:
            self._answers.append(answer)
            self._held += len(answer)
            if self._held > self.capacity:  # drop to 3/4 of capacity, so rebuilding costs O(1) a token amortised
                while self._held > self.capacity * 3 // 4 and len(self._answers) > 1:
                    self._held -= len(self._answers.popleft())
                self._rebuild()
            else:
                self._tokens += answer + [SEPARATOR]
                self._index.update(self._tokens)

    def drafts(self, text: Sequence[int], length: int, branches: int = 1) -> list[SuffixDraft]:
        """Up to `branches` distinct drafts of at most `length` tokens for what follows `text`: the continuations,
        within their answer, of the latest occurrences of the text's longest ending found (then shorter ones)."""
        if length < 1 or branches < 1:
            return []
        with self._lock:
            tokens = self._tokens
            return self._index.drafts_for(text, branches, lambda end: tuple(itertools.takewhile(
                lambda t: t != SEPARATOR, tokens[end + 1:end + 1 + length])))

    def _rebuild(self) -> None:
        self._tokens = [t for answer in self._answers for t in answer + [SEPARATOR]]
        self._index = SuffixIndex(self.max_key, self.keep)
        self._index.update(self._tokens)
