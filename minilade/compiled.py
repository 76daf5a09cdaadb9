"""Plain decoding's one-token step as one compiled graph: speed where bitwise agreement with lookahead is not asked.

A decoding step of `Transformer.forward` is written for any shape: the cache is sliced to the rows written so
far, attention may be batch-invariant (invariance.py, so that a token's logits are the same in a one-row step and
in a wide lookahead step), and the step's mask is built on the host. On a CPU that costs some 2,000 small eager
operations per token, which take longer than the weight matmuls of a quantized model (docs/benchmarks.md).

`one_token_logits` is the same layer stack for the one case of plain decoding, written with static shapes:
attention reads every slot of the cache, the slots after the token's own hidden by a mask computed inside the
graph, and the token's keys and values are written with `index_copy_`. torch.compile (inductor) then fuses the
small operations of the whole stack around the weight matmuls. Its logits are those of the stock kernels up to
rounding, not bitwise those of a lookahead step, so only plain decoding uses it (`CompiledAutoregressive`,
`make_strategy("autoregressive", compiled=True)`, CLI `--compile`), and lookahead and `auto` keep their promise of
plain decoding's exact output by running the eager, batch-invariant steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .decoding.base import DecodeContext, Decoder, Step, StepKind, Strategy
from .kv_cache import KVCache
from .model import Transformer

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def one_token_logits(model: Transformer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One token through the model, its keys and values written into an unpadded cache.

    x: (B, 1, dim) the token's embedding in the model's dtype; cos, sin: (1, 1, 1, D) its rotary rows
    (`model.rotary`); pos: (1,) long, its position, which is also its cache slot; keys, values: (L, B, Hkv, S, D),
    the buffers of a plain KVCache (slots [0, pos) hold the committed tokens). Writes slot pos
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
    if dist.is_available() and dist.is_initialized():
        raise ValueError("a compiled step runs a model on one process, not in a process group (a sharded model)")
    return functools.partial(_compiled(), model)


@functools.cache
def _compiled() -> Callable[..., torch.Tensor]:
    """One compiled function for every model. Dynamo guards on what the graph read of the model it is given (its
    layers, config and the shapes of its weights, which enter as inputs) and reuses a graph or compiles another;
    past torch._dynamo.config.recompile_limit graphs, a call runs one_token_logits eagerly."""
    return torch.compile(one_token_logits, fullgraph=True, options={"cpp_wrapper": True})


@dataclass(frozen=True)
class CompiledAutoregressive(Strategy):
    """Plain decoding whose one-token steps run as one compiled graph: faster, and its tokens are those of the
    stock kernels, not bitwise those the batch-invariant steps of lookahead and auto give."""

    name = "autoregressive"

    def cache_type(self, model: Transformer) -> type[KVCache]:
        return KVCache  # one_token_logits writes and reads the plain layout

    def make_decoder(self, ctx: DecodeContext) -> Decoder:
        return CompiledDecoder(ctx)


class CompiledDecoder(Decoder):
    """Plain decoding whose steps after the prefill run one_token_logits, compiled. The prefill runs
    Transformer.forward (causal attention over the prompt, the same with any attention kernel)."""

    def __init__(self, ctx: DecodeContext) -> None:
        super().__init__(ctx)
        if type(ctx.cache) is not KVCache:
            raise ValueError(f"a compiled step needs a plain KVCache, not a {type(ctx.cache).__name__}")
        self.run = compiled_step(ctx.model)
        for buffer in (ctx.cache.k, ctx.cache.v):
            torch._dynamo.mark_dynamic(buffer, 3)  # the slot count: one graph for every cache capacity

    def step(self) -> Step:
        ctx, model = self.ctx, self.ctx.model
        ctx.cache.check_room(1)
        pos = torch.tensor([ctx.cache.length], device=ctx.device)
        cos, sin = model.rotary(pos.view(1, 1))
        x = model.tok_embeddings(torch.tensor([ctx.tokens[-1:]], device=ctx.device)).to(model.dtype)
        logits = self.run(x, cos, sin, pos, ctx.cache.k, ctx.cache.v)
        ctx.cache.commit(1)
        return Step(self.emit([int(ctx.sampler.pick(ctx.sampler.penalize(logits[0, -1])))]), StepKind(), 1)
