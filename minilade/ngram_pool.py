"""The n-gram pool: continuations seen so far, keyed by the token they follow."""

from __future__ import annotations

from typing import Sequence


class NGramPool:
    """For each key token, the (N-1)-token continuations that followed it, most recently seen last.

    Each key keeps at most `capacity` distinct continuations; adding one that is already there makes it the
    most recent, and adding to a full key evicts the least recently seen. The per-key dict doubles as an
    ordered set, so a continuation is stored (and later verified) once. Each entry remembers whether only the
    lookahead window has produced it so far (as opposed to the text itself), so the window's worth can be told.
    """

    def __init__(self, ngram: int, capacity: int) -> None:
        if ngram < 2:
            raise ValueError(f"ngram size must be >= 2, got {ngram}")
        if capacity < 1:
            raise ValueError(f"pool capacity must be >= 1, got {capacity}")
        self.ngram = ngram
        self.capacity = capacity
        self._pool: dict[int, dict[tuple[int, ...], bool]] = {}  # key -> continuation -> made by the window only
        self.text_read = 0  # add_text: the n-grams of the text that begin before this index are in the pool

    def __len__(self) -> int:
        return sum(len(conts) for conts in self._pool.values())

    def add(self, key: int, continuation: tuple[int, ...], from_window: bool = False) -> None:
        if len(continuation) != self.ngram - 1:
            raise ValueError(f"continuation {continuation} should have {self.ngram - 1} tokens")
        conts = self._pool.setdefault(key, {})
        window_only = conts.pop(continuation, True) and from_window
        conts[continuation] = window_only
        if len(conts) > self.capacity:
            del conts[next(iter(conts))]

    def from_window(self, key: int, continuation: tuple[int, ...]) -> bool:
        """Whether the lookahead window, and never the text, produced this continuation."""
        return self._pool.get(key, {}).get(continuation, False)

    def add_ngrams(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add every n-gram of `tokens` that begins at index >= start."""
        n = self.ngram
        for i in range(start, len(tokens) - n + 1):
            self.add(tokens[i], tuple(tokens[i + 1:i + n]))

    def add_text(self, text: Sequence[int]) -> None:
        """Add the n-grams the text gained since the last add_text or skip_text (the text only grows)."""
        self.add_ngrams(text, self.text_read)
        self.skip_text(text)

    def skip_text(self, text: Sequence[int]) -> None:
        """Mark the text's n-grams so far as read without adding them."""
        self.text_read = max(0, len(text) - self.ngram + 1)

    def candidates(self, key: int, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` continuations of `key`, most recently seen first."""
        conts = self._pool.get(key)
        if not conts or limit <= 0:
            return []
        out = []
        for cont in reversed(conts):
            out.append(cont)
            if len(out) == limit:
                break
        return out
