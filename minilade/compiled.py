"""Plain decoding's one-token step as one compiled graph: speed where bitwise agreement with lookahead is not asked.

A decoding step of `Transformer.forward` is written for any shape: the cache is sliced to the rows written so
far, attention is batch-invariant (invariance.py) so that a token's logits are the same in a one-row step and in a
wide lookahead step, and the step's mask is built on the host. On a CPU that costs some 2,000 small eager
operations per token, which take longer than the weight matmuls of a quantized model (docs/benchmarks.md).

`one_token_logits` is the same layer stack for the one case of plain decoding, written with static shapes:
attention reads every slot of the cache, the slots after the token's own hidden by a mask computed inside the
graph, and the token's keys and values are written with `index_copy_`. torch.compile (inductor) then fuses the
small operations of the whole stack around the weight matmuls. Its logits are those of the stock kernels up to
rounding, not bitwise those of a lookahead step, so only plain decoding uses it (`Autoregressive(compiled=True)`,
CLI `--compile`), and lookahead and `auto` keep their promise of plain decoding's exact output by running the
eager, batch-invariant steps.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from .model import Transformer
from .parallel.layers import process_group

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def one_token_logits(model: Transformer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One token through the model, its keys and values written into an unpadded cache.

    x: (B, 1, dim) the token's embedding in the model's dtype; cos, sin: (1, 1, 1, D) its rotary rows
    (`model.rotary`); pos: (1,) long, its position, which is also its cache slot; keys, values: (L, B, Hkv, S, D),
    the buffers of a KVCache made with invariant=False (slots [0, pos) hold the committed tokens). Writes slot pos
    of every layer and attends to slots [0, pos] (and, with a sliding window, only the last `sliding_window` of
    them). Returns logits (B, 1, V) in the model's dtype.
    """
    B = x.shape[0]
    config = model.config
    slots = torch.arange(keys.shape[3], device=x.device)
    visible = slots <= pos
    if config.sliding_window:
        visible &= slots > pos - config.sliding_window
    visible = visible.view(1, 1, 1, -1)
    for i, layer in enumerate(model.layers):
        attention = layer.attention
        q, k, v = attention.project(layer.attention_norm(x), cos, sin)
        keys[i].index_copy_(2, pos, k.to(keys.dtype))
        values[i].index_copy_(2, pos, v.to(values.dtype))
        y = F.scaled_dot_product_attention(q, keys[i].to(q.dtype), values[i].to(q.dtype), attn_mask=visible,
                                           enable_gqa=attention.n_heads != attention.n_kv_heads)
        x = x + attention.wo(y.transpose(1, 2).reshape(B, 1, -1))
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.output(model.norm(x))


def compiled_step(model: Transformer) -> StepFn:
    """one_token_logits for this model under torch.compile. The first call for a model compiles (minutes on a
    CPU; inductor keeps what it built on disk, so later processes take seconds); the cache's slot count is a
    dynamic dimension, so caches of another capacity reuse the graph. The graph's host code is C++ (inductor's
    cpp_wrapper), which measured faster than its Python wrapper (docs/benchmarks.md). CPU only: on CUDA it has
    never run (no device was lent to measure and test it)."""
    if model.device.type != "cpu":
        raise ValueError(f"compiled steps are built and tested for the CPU only, not {model.device.type}; "
                         f"decode without --compile there")
    if process_group(model) is not None:
        raise ValueError("a compiled step runs a model on one process, not one sharded over a process group")
    return functools.partial(_compiled(), model)


@functools.cache
def _compiled() -> Callable[..., torch.Tensor]:
    """One compiled function for every model. Dynamo guards on what the graph read of the model it is given (its
    layers, config and the shapes of its weights, which enter as inputs) and reuses a graph or compiles another;
    past torch._dynamo.config.recompile_limit graphs, a call runs one_token_logits eagerly."""
    return torch.compile(one_token_logits, fullgraph=True, options={"cpp_wrapper": True})
