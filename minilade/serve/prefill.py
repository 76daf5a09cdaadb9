"""How the server runs a prompt's prefill: from the K/V kept for a prefix it shares with a finished request, and
in chunks, so that the requests already running keep streaming while a long prompt is read.

The next turn of a chat resends the whole conversation: its prompt begins with the previous turn's prompt and
answer, whose K/V a finished request already computed. `PrefixCache` keeps the committed K/V rows of finished
requests (token ids and their rows, copied out of the request's cache), least recently used first out, within a
byte budget. A new request's prefill then copies the rows of the longest common prefix into its own cache and runs
only the rest of the prompt in chunks (`prefill_calls`), each pass shared with the running requests' steps:
PREFILL_PER_REQUEST rows per pass for each running request, at least PREFILL_CHUNK, while others run (they wait
at most one such pass), PREFILL_ALONE while none does (nobody waits, and wider passes read a prompt sooner).

The answer is the same with or without reuse, in one piece or in chunks: with the exact backend every row of a
prefill goes through the batch-invariant attention (invariance.ExactAttention), so the K/V and logits of row r
depend only on the tokens up to r, not on how the prompt was split between passes (text_stream.splits_exactly;
elsewhere the prefill runs whole, and nothing is kept). A finished request's answer rows are kept only where its
steps wrote the bits a prefill gives the same tokens (text_stream.reusable_rows: not under compiled steps).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..kv_cache import KVCache
from ..verify import common_prefix
from .batched import ForwardCall

MIN_REUSE = 4  # fewer common tokens than this are recomputed: not worth a copy
# Prompt rows per pass while others run: a part's rows hold up the running requests' next tokens (they wait at most
# one such pass), and each pass a prompt takes costs their host work once more, which grows with their number.
PREFILL_CHUNK = 8  # at least
PREFILL_PER_REQUEST = 2  # for each running request
PREFILL_ALONE = 256  # prompt rows per pass while no other request runs (one block of invariance.CausalPrefill)


@dataclass
class Kept:
    """A finished request's committed rows: ids (n,), keys and values (n_layers, 1, Hkv, n, ...), as its cache
    stores them."""

    ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass
class Hit:
    """The rows a new request reuses: the first `n` of `kept`."""

    kept: Kept
    n: int


class PrefixCache:
    """Kept rows of finished requests, within budget_bytes (0: nothing kept). Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._entries: OrderedDict[int, Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def keep(self, ids: list[int], cache: KVCache) -> None:
        """Keep the K/V of ids, the first len(ids) committed rows of cache (fewer if it has fewer)."""
        n = min(len(ids), cache.length)
        if n < MIN_REUSE or not self.budget:
            return
        kept = Kept(tuple(ids[:n]), cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone())
        if kept.nbytes > self.budget:
            return
        with self._lock:
            self._entries[id(kept)] = kept
            self._bytes += kept.nbytes
            while self._bytes > self.budget:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes

    def find(self, prompt: list[int]) -> Hit | None:
        """The kept rows sharing the longest prefix with prompt, at most all but its last token (the prefill must
        compute the last row's logits), or None under MIN_REUSE."""
        with self._lock:
            best, n = None, 0
            for key, kept in self._entries.items():
                m = min(common_prefix(kept.ids, prompt), len(prompt) - 1)
                if m > n:
                    best, n = key, m
            if best is None or n < MIN_REUSE:
                return None
            self._entries.move_to_end(best)
            return Hit(self._entries[best], n)


def is_prefill(call: ForwardCall, prompt_len: int) -> bool:
    """The decoder's prefill: the whole prompt, causal, into an empty cache, logits of chosen rows only."""
    return (call.cache.length == 0 and call.tokens.shape[1] == prompt_len and call.mask is None
            and call.logits_rows is not None)


def chunk_end(a: int, T: int, first_logits_row: int, chunk: int) -> int:
    """Where the prefill pass that begins at row a of T ends: after `chunk` rows, or at T where the pass would
    otherwise end amid the rows whose logits are asked for (from first_logits_row on): the last pass holds them all."""
    b = min(a + chunk, T)
    return T if b > first_logits_row else b


def prefill_calls(call: ForwardCall, hit: Hit | None, chunk: int | Callable[[], int] = PREFILL_CHUNK
                  ) -> tuple[int, Iterator[ForwardCall]]:
    """The prefill's call as the calls to run instead, and how many prompt rows come from `hit`: its rows copied
    into the cache, then the rest of the prompt in passes of `chunk` rows (or as many as chunk() says when each pass
    is due; chunk_end), each at the cache length its rows start at, the last asking for the prefill's logits rows.
    The caller sets the cache's length back to 0 after them, since the decoder commits the whole prompt itself."""
    cache, T, rows = call.cache, call.tokens.shape[1], call.logits_rows
    start = min(hit.n, int(rows.min())) if hit is not None else 0
    if start:
        cache.k[:, :, :, :start] = hit.kept.k[:, :, :, :start]
        cache.v[:, :, :, :start] = hit.kept.v[:, :, :, :start]
    positions = call.input_pos.reshape(-1)

    def calls() -> Iterator[ForwardCall]:
        a = start
        while a < T:
            b = chunk_end(a, T, int(rows.min()), chunk() if callable(chunk) else chunk)
            cache.length = a
            yield ForwardCall(call.tokens[:, a:b], positions[a:b], cache, None, rows - a if b == T else rows[:0],
                              prefill_part=True)
            a = b
    return start, calls()
