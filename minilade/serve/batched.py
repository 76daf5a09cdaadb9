"""One forward pass over the rows of several generations, each over its own KV cache and mask.

Every request's decoder asks for a forward pass exactly as it asks the model alone (`Transformer.forward`'s
arguments: a `ForwardCall`). `batched_forward` runs the calls of one step together:

    tokens of call 0 | tokens of call 1 | ...            concatenated along T: x (1, sum T_i, dim)
    embedding, norms, wqkv, wo, gate_up, down            over all rows at once (weights read once per step)
    rotary                                               each row by its own call's positions
    attention                                            per call: its q, k, v rows, its cache, its mask
                                                         (calls of one causal shape stacked: stacked.py)
    output head                                          only each call's logits_rows

A row's result depends only on its own call: the norms, rotary, SiLU and residual adds work row by row; the weight
matmuls of an exact model are row-count invariant (invariance.RowTiledLinear); attention runs per call, on the very
tensors the call alone would give it, or stacked with others in a way that gives it the same bits (stacked.py). So
each call gets bitwise the logits the model gives it alone.

Where the model's decoding steps are native or compiled (native_steps.py, compiled.py), they round otherwise than
eager ones, and a call gets what the model gives it alone only by running as the model runs it alone
(`runs_compiled`): a decoding step with its own step's bits, a prompt's prefill (and each of its parts, prefill.py)
through the eager layers. Such calls of a pass share native or compiled passes of their own (native_pass.py,
compiled_pass.py) or run one after another; the eager ones share a pass as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..kv_cache import KVCache
from ..model import Attention, Transformer, check_mask
from .stacked import Stack, attend_stacked, stacks


@dataclass
class ForwardCall:
    """One decoder's forward pass: Transformer.forward's arguments.

    tokens: (1, T) ids; input_pos: (T,) or (1, T) rotary positions; mask: (T, T) bool or None (causal);
    logits_rows: (R,) rows to project to the vocabulary, None for all T.
    """

    tokens: torch.Tensor
    input_pos: torch.Tensor
    cache: KVCache
    mask: torch.Tensor | None = None
    logits_rows: torch.Tensor | None = None
    prefill_part: bool = False  # a part of a prompt's prefill (prefill.prefill_calls): run as the whole prefill runs


def runs_compiled(model: Transformer, call: ForwardCall) -> bool:
    """Whether the model alone runs this call through its step runner (native or compiled steps): every call where
    the runner runs prefills too (native steps); else a step over a cache holding rows, except a part of a prefill
    (the model alone runs the whole prompt eagerly)."""
    runner = model.step_runner
    return runner is not None and (runner.runs_prefill or call.cache.length > 0 and not call.prefill_part)


@dataclass
class PreparedCall:
    """What a call needs inside the pass: its rotary rows (1, T, 1, D), its kernel step (both None for a call its
    step runner runs, which makes its own), its logits rows (R,)."""

    call: ForwardCall
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    step: Any
    rows: torch.Tensor

    @property
    def T(self) -> int:
        return self.call.tokens.shape[1]


def prepare_call(model: Transformer, call: ForwardCall) -> PreparedCall:
    """Check a call as Transformer.forward does (room in its cache, positions inside the rotary tables, mask
    shape: a ValueError for this call alone) and make what every eager layer needs of it (a compiled call's step
    makes its own)."""
    B, T = call.tokens.shape
    if B != 1:
        raise ValueError(f"a shared forward pass takes one sequence per call, got tokens of shape "
                         f"{tuple(call.tokens.shape)}")
    call.cache.check_room(T)
    model.cover_positions(call.cache.capacity)
    rows = (call.logits_rows if call.logits_rows is not None else torch.arange(T, device=model.device)).to(model.device)
    if runs_compiled(model, call):  # its step makes its own rotary rows and masks
        check_mask(call.mask, T)
        return PreparedCall(call, None, None, None, rows)
    input_pos = call.input_pos.reshape(1, T)
    cos, sin = model.rotary(input_pos)  # (1, T, 1, D)
    past = call.cache.length
    visible, reach = model.step_masks(call.mask, past, T, input_pos)
    return PreparedCall(call, cos, sin, model.attention_kernel.prepare(visible, reach, past, model.dtype), rows)


def batched_forward(model: Transformer, calls: list[PreparedCall],
                    compiled: Callable[[Transformer, list[ForwardCall]], list[torch.Tensor]] | None = None
                    ) -> list[torch.Tensor]:
    """Logits of each call, (1, R_i, V) in the model dtype: the eager calls computed in one pass over all their
    rows (eager_forward), the others (runs_compiled) by `compiled` (native_pass.NativePasses or
    compiled_pass.SharedPasses), or each by the model's own step runner.

    Each call's K/V are written into its own cache at [length, length + T_i); no cache length changes (the
    call's decoder commits or compacts afterwards, as after Transformer.forward).
    """
    logits: list[torch.Tensor | None] = [None] * len(calls)
    kinds: tuple[list[int], list[int]] = ([], [])  # eager, compiled
    for i, p in enumerate(calls):
        kinds[runs_compiled(model, p.call)].append(i)
    eager, steps = kinds
    if steps:
        for i, result in zip(steps, (compiled or one_after_another)(model, [calls[i].call for i in steps])):
            logits[i] = result
    if eager:
        for i, result in zip(eager, eager_forward(model, [calls[i] for i in eager])):
            logits[i] = result
    return logits


def one_after_another(model: Transformer, calls: list[ForwardCall]) -> list[torch.Tensor]:
    """Logits of each call, each through Transformer.forward alone."""
    return [model(c.tokens, c.input_pos, c.cache, c.mask, c.logits_rows) for c in calls]


def eager_forward(model: Transformer, calls: list[PreparedCall]) -> list[torch.Tensor]:
    """Logits of each call, (1, R_i, V), in one pass of the eager layers over all their rows (never the model's
    compiled step). A call alone in the pass runs through Transformer.forward itself where that is eager."""
    if len(calls) == 1 and (model.step_runner is None or not calls[0].call.cache.length):
        call = calls[0].call
        return [model(call.tokens, call.input_pos, call.cache, call.mask, call.logits_rows)]
    sizes = [p.T for p in calls]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    tokens = torch.cat([p.call.tokens for p in calls], dim=1)  # (1, sum T)
    cos = torch.cat([p.cos for p in calls], dim=1)  # (1, sum T, 1, D)
    sin = torch.cat([p.sin for p in calls], dim=1)
    x = model.tok_embeddings(tokens).to(model.dtype)  # (1, sum T, dim)
    # Stacked attention is checked bit for bit against each call alone on the CPU's kernels; elsewhere calls attend
    # alone.
    together = stacks([p.step for p in calls]) if model.device.type == "cpu" else []
    for i, layer in enumerate(model.layers):
        x = x + attend(layer.attention, layer.attention_norm(x), cos, sin, calls, starts, i, model, together)
        x = x + layer.feed_forward(layer.ffn_norm(x))
    rows = torch.cat([start + p.rows for start, p in zip(starts, calls)])
    logits = model.output(model.norm(x[:, rows]))  # (1, sum R, V)
    return list(logits.split([p.rows.numel() for p in calls], dim=1))


def attend(attention: Attention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, calls: list[PreparedCall],
           starts: list[int], layer: int, model: Transformer, together: list[Stack]) -> torch.Tensor:
    """One layer's attention: q, k, v projected for all rows together, then each call's rows attend over its own
    cache through its own prepared step, the calls of each stack in one kernel call (stacked.py).
    h: (1, sum T, dim) -> (1, sum T, dim)."""
    q, k, v = attention.project(h, cos, sin)  # (1, H, sum T, D), (1, Hkv, sum T, D) x 2
    rows = [slice(a, a + p.T) for a, p in zip(starts, calls)]
    out: list[torch.Tensor | None] = [None] * len(calls)
    for stack in together:
        parts = [torch.cat([t[:, :, rows[i]] for i in stack.members]) for t in (q, k, v)]  # (B, H|Hkv, T, D)
        y = attend_stacked(stack, *parts, [calls[i].call.cache for i in stack.members], layer)
        for b, i in enumerate(stack.members):
            out[i] = y[b:b + 1]
    kernel = model.attention_kernel
    for i, p in enumerate(calls):
        if out[i] is None:
            out[i] = kernel(q[:, :, rows[i]], k[:, :, rows[i]], v[:, :, rows[i]], p.call.cache, layer, p.step)
    y = torch.cat(out, dim=2)  # (1, H, sum T, D)
    return attention.wo(y.transpose(1, 2).reshape(1, h.shape[1], -1))
