"""Suffix drafts: propose what followed the longest earlier occurrence of the text's own ending.

The index maps every k-gram of the text (k = 1..max_key) to the end positions of its latest occurrences. It is
updated as tokens are appended, O(max_key) per token, and a lookup tries the text's last max_key, ..., 1 tokens:
the longest that occurred before (ending earlier than the text does) is the match. A draft copies what followed
an occurrence; where the copy runs into the text's own end it keeps copying from the tokens it has drafted
(text + draft), which is what looking the extended text up again would find, so a repeating pattern is drafted
past the end of the text (a draft may be longer than N - 1). Occurrences whose continuations differ give
different drafts: the branches of a small tree.

Invariants: positions index the token list the index was fed (append-only; `update` indexes what was appended
since the last call); no key spans a SEPARATOR (history.py joins several texts with it). Memory: at most max_key
keys per token of the text and `keep` positions per key, so it is bounded by max_key * keep * (context length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

SEPARATOR = -1  # never a token id: a list of several texts holds it between them, and no key spans it


@dataclass(frozen=True)
class SuffixDraft:
    """One drafted path: tokens proposed to follow the text, and the match it came from.

    match: how many of the text's last tokens the occurrence shares (the key length, 1..max_key); the i-th
    drafted token then continues a match of match + i tokens. rank: 0 for the most recent occurrence of the
    longest matching key, then 1, 2, ... for the other branches, in the order they were proposed.
    """

    tokens: tuple[int, ...]
    match: int
    rank: int


class SuffixIndex:
    """Latest end positions of every k-gram (k = 1..max_key) of a growing token list."""

    def __init__(self, max_key: int = 8, keep: int = 4) -> None:
        if max_key < 1:
            raise ValueError(f"suffix key length must be >= 1, got {max_key}")
        if keep < 1:
            raise ValueError(f"occurrences kept per key must be >= 1, got {keep}")
        self.max_key, self.keep = max_key, keep
        self.indexed = 0  # tokens indexed so far
        self._ends: dict[tuple[int, ...], list[int]] = {}  # k-gram -> end positions, most recent last

    def __len__(self) -> int:
        return len(self._ends)

    def update(self, tokens: Sequence[int]) -> None:
        """Index the tokens appended since the last call (tokens must extend the list indexed so far)."""
        for end in range(self.indexed, len(tokens)):
            for k in range(1, min(self.max_key, end + 1) + 1):
                if tokens[end - k + 1] == SEPARATOR:
                    break
                ends = self._ends.setdefault(tuple(tokens[end - k + 1:end + 1]), [])
                ends.append(end)
                if len(ends) > self.keep:
                    del ends[0]
        self.indexed = len(tokens)

    def match(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """(k, ends): the longest k such that the last k tokens occurred ending before the text's last token,
        and those earlier end positions, most recent first; (0, []) when not even the last token recurs."""
        self.update(tokens)
        n = len(tokens)
        for k in range(min(self.max_key, n - 1), 0, -1):
            earlier = [e for e in reversed(self._ends.get(tuple(tokens[n - k:]), ())) if e < n - 1]
            if earlier:
                return k, earlier
        return 0, []

    def drafts(self, tokens: Sequence[int], length: int, branches: int = 1) -> list[SuffixDraft]:
        """Up to `branches` distinct drafts of `length` tokens, from the latest occurrences of the longest matching
        key first, then of shorter keys (an occurrence of a longer key is one of every shorter key too, so each
        end position is drafted from once, with its longest match)."""
        if length < 1 or branches < 1:
            return []
        self.update(tokens)
        n = len(tokens)
        return self.drafts_for(tokens, branches, lambda end: copy_after(tokens, end, length) if end < n - 1 else ())

    def drafts_for(self, query: Sequence[int], branches: int, path_at: Callable[[int], tuple[int, ...]]
                   ) -> list[SuffixDraft]:
        """Up to `branches` distinct non-empty drafts path_at(end) for the indexed occurrences of the query's
        last k tokens, k = max_key, ..., 1 (longest first, then most recent first; each end position once, with
        its longest match). The query may be the indexed text itself (drafts) or another text (history.py)."""
        out: list[SuffixDraft] = []
        seen_ends: set[int] = set()
        seen_paths: set[tuple[int, ...]] = set()
        for k in range(min(self.max_key, len(query)), 0, -1):
            for end in reversed(self._ends.get(tuple(query[len(query) - k:]), ())):
                if end in seen_ends:
                    continue
                seen_ends.add(end)
                path = path_at(end)
                if path and path not in seen_paths:
                    seen_paths.add(path)
                    out.append(SuffixDraft(path, k, len(out)))
                    if len(out) == branches:
                        return out
        return out


def copy_after(tokens: Sequence[int], end: int, length: int) -> tuple[int, ...]:
    """`length` tokens following position end (< len(tokens) - 1), continuing into the copy itself where the text
    ends: draft[i] = (tokens + draft)[end + 1 + i]."""
    n = len(tokens)
    draft: list[int] = []
    for i in range(length):
        j = end + 1 + i
        draft.append(tokens[j] if j < n else draft[j - n])
    return tuple(draft)
