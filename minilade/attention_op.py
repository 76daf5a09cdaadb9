"""The sums that end a compiled step's attention as one C++ operator: `minilade_attention::weighted_sums`
(csrc/weighted_sums.cpp).

Written in torch operations (compiled.chunked_attention), a step's attention is some ten small operations a layer,
which inductor turns into three external matmuls, a cumulative sum and a few generated loops, one of which copies
the values into the layout the chunks' matmul takes: 1.8 of 7.3 ms of a one-row step of the demo model, 3.0 of
9.2 ms of an 8-row one (the layers' graph with and without attention, interleaved in one process). The operator
takes the rows' softmax numerators (the scores stay one matmul in the graph) and computes the chunks' weighted sums
of the values in the layout the cache keeps them, each row's in an order that depends on nothing but the row's keys
(the source's header says how), so a row's result is the same at every width of step, as chunked_attention's is. Its
rounding is not chunked_attention's, so a model whose steps are compiled runs them all through the operator or none
(the exactness check and the graphs are kept per runner, whose name says which: compiled.CompiledSteps). Built for
this processor (-march=native) on first use. With it the demo model's layers took 0.7 ms less a step after 100
tokens (5.6 against 6.3 ms at one row, 7.0 against 7.7 at eight) and 1.4 / 2.5 ms less after 400 (7.9 against 9.3,
12.7 against 15.2), the two graphs interleaved in one process.

The graph still hands the operator a copy of the layer's values with the step's rows written in (inductor writes
the rows into a new buffer rather than into the cache's view, when an operator it cannot see into reads it), then
writes the rows into the cache. Not avoided: with the operator reading the cache before the rows are written (and
the rows beside it), the graph copied the values at the write after it and copied them back; an operator that
writes the rows itself (an input it mutates) cannot be functionalized inside a nested compile region in torch 2.13.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import native
from .invariance import KEY_CHUNK

SOURCE = Path(__file__).parent / "csrc" / "weighted_sums.cpp"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]  # OpenMP: at::parallel_for
_loaded = False


def load() -> str | None:
    """Build (once a machine) and load the operator; None when it is loaded, else why not, in one line."""
    global _loaded
    if _loaded:
        return None
    missing = native.build("weighted_sums", SOURCE, CFLAGS, what="attention", for_processor=True)
    if missing is None:
        torch.library.register_fake("minilade_attention::weighted_sums", _shape)
        _loaded = True
    return missing


def loaded() -> bool:
    """Whether compiled steps end their attention with the operator (load() loaded it in this process)."""
    return _loaded


def serves(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the operator ends an attention over these queries, keys and values: loaded, and all of them float32
    (it computes in float32 only; other dtypes keep compiled.chunked_attention)."""
    return _loaded and q.dtype == keys.dtype == values.dtype == torch.float32


def weighted_sums(q: torch.Tensor, weights: torch.Tensor, values: torch.Tensor, shared: torch.Tensor,
                  tail_keys: torch.Tensor, tail_select: torch.Tensor) -> torch.Tensor:
    """The operator's sums as a step's attention output: q (B, H, T, D); weights (B, Hkv, R, Sp), the softmax
    numerators (compiled.attention_weights); values (B, Hkv, Sp, value_columns(D)); each sequence's layout, shared
    (B, Sp), tail_keys (B, n), tail_select (B, n_tail, R, n) (compiled.graph_layout's, a batch dimension in front).
    Returns (B, H, T, D)."""
    B, H, T, D = q.shape
    out = torch.ops.minilade_attention.weighted_sums(q, weights, values, shared, tail_keys, tail_select, KEY_CHUNK)
    return out.unflatten(2, (H // values.shape[1], T)).flatten(1, 2)  # (B, Hkv, G * T, D) -> (B, H, T, D)


def _shape(q: torch.Tensor, weights: torch.Tensor, values: torch.Tensor, shared: torch.Tensor,
           tail_keys: torch.Tensor, tail_select: torch.Tensor, key_chunk: int) -> torch.Tensor:
    B, H, T, D = q.shape
    Hkv = weights.shape[1]
    return values.new_empty(B, Hkv, H // Hkv * T, D)  # (B, Hkv, G * T, D)
