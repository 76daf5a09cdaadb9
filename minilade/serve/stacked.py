"""Attention of several calls of one shared pass as one kernel call, each bitwise what it gets alone.

In a shared pass each call attends over its own cache (batched.attend), and with exact attention
(invariance.invariant_attention) that is a dozen small operations per call and layer whatever the call's size:
at 8 one-row calls a pass spent about 40% of its time there (py-spy). Calls whose steps are causal and of one
shape (plain decoding's one-row steps; any call whose rows see a prefix of its slots) stack instead: queries, keys
and values along the batch dimension, each call's key bias padded to the longest call's keys with hidden slots,
then one invariant_attention. A call's result does not change:
- a hidden key weighs exactly 0 (its bias is -inf), and the row maxima see the same keys;
- its chunks are the ones it has alone (every chunk of a causal step is cut by slot), the same matmul shapes, and
  the chunks past its own keys hold only hidden keys, so the scan adds exact zeros after its last chunk;
- the score matmul over more key columns gives each column the same bits (invariance.COL_TILE).
tests/serve/test_stacked.py checks it bit for bit against the call alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..invariance import KeyLayout, invariant_attention, padded_views
from ..kv_cache import KVCache


@dataclass(frozen=True)
class Stack:
    """Calls of one pass whose attention runs as one: their indices in the pass, and the layout they share, whose
    key_bias is (B, 1, rows, keys): each call's own, padded with hidden keys to the longest."""

    members: tuple[int, ...]
    layout: KeyLayout


def stacks(steps: Sequence[object]) -> list[Stack]:
    """Groups of two or more calls, given their prepared steps (the attention kernel's `prepare`), whose steps are
    causal KeyLayouts of one shape (rows T and padded rows). Any other step (a lookahead step's, a prefill's, another
    kernel's) is in no group: its call attends alone."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, step in enumerate(steps):
        if isinstance(step, KeyLayout) and step.tail_select is None:
            groups.setdefault((step.T, step.rows), []).append(i)
    found = []
    for members in groups.values():
        if len(members) < 2:
            continue
        layouts = [steps[i] for i in members]
        keys = max(layout.keys for layout in layouts)
        bias = torch.stack([F.pad(layout.key_bias, (0, keys - layout.keys), value=-torch.inf) for layout in layouts])
        first = layouts[0]
        found.append(Stack(tuple(members), KeyLayout(0, first.T, first.rows, keys, keys // first.chunk, first.chunk,
                                                     bias[:, None], None)))
    return found


def attend_stacked(stack: Stack, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: Sequence[KVCache],
                   layer: int) -> torch.Tensor:
    """One layer's attention of a stack's calls. q: (B, H, T, D), k and v: (B, Hkv, T, D), call b's rows in batch
    entry b, written into caches[b] first (as ExactAttention does). Returns (B, H, T, D)."""
    keys, values = [], []
    for b, cache in enumerate(caches):
        cache.write(layer, k[b:b + 1], v[b:b + 1])
        kb, vb = padded_views(cache, layer, stack.layout.keys)
        missing = stack.layout.keys - kb.shape[2]  # a smaller cache than the longest call's keys: zero slots
        keys.append(F.pad(kb, (0, 0, 0, missing)) if missing else kb)
        values.append(F.pad(vb, (0, 0, 0, missing)) if missing else vb)
    return invariant_attention(q, torch.cat(keys), torch.cat(values), stack.layout)
