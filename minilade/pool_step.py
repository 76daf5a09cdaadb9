"""One-row decoding steps of many generations as one compiled graph: their caches are slots of one buffer.

A server's generations mostly ask for one-row steps. Run through compiled.pass_layer_step, each call attends over
its own cache with a dozen small operations of its own, and those, not the weight matmuls, make up most of a pass
(four one-row calls of the demo model: 20 ms against 9 for one). Here the caches of the calls are slots of one
buffer, (n_layers, slots, Hkv, capacity, ...) as a PaddedKVCache of as many sequences keeps them
(serve/cache_pool.py), and `pool_layer_step` runs every slot's row through one layer at once, attention included:
one operation a step over all slots instead of one per call (`pool_layers_step`: every layer, one graph). Slots
that hold no call of the pass (free, or a generation whose step is wider) go along with a dummy row that writes
nothing and is not read.

Each slot's row gets the bits of its own compiled one-row step (compiled.layers_step): the same weight matmuls
(row-count invariant) and the same sums in attention. `pool_attention` computes chunked_attention's sums, each
slot over its own layout: a one-row step sees a prefix of the slots, so its layout has shared chunks up to L0 and
its last chunk as the tail (compiled.graph_layout); padded to the pass's widest slot, the chunks past a slot's L0
weigh exactly 0, and the scan adds the same non-zero chunk sums in the same order. serve/cache_pool.py checks the
bits against each call alone when the engine starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import attention_op
from .compiled import attention_weights, mark_dims
from .invariance import KEY_CHUNK, work_dtype
from .model import Block


def pool_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor,
                   shared: torch.Tensor, tail_keys: torch.Tensor, tail_select: torch.Tensor) -> torch.Tensor:
    """compiled.step_attention for B one-row steps, each over its own slot of the keys with its own layout: the C++
    operator, handed each slot's layout, where compiled steps attend through it, else chunked_attention's sums.

    q: (B, H, 1, D); keys: (B, Hkv, Sp, D), values: (B, Hkv, Sp, value_columns(D)), Sp a multiple of KEY_CHUNK;
    each slot's graph_layout padded to Sp (stack_layouts): key_bias (B, R, Sp), shared (B, Sp), tail_keys (B, C)
    long, the slots of its tail chunk, tail_select (B, n_tail, R, C). Returns (B, H, 1, D) in q's dtype."""
    B, H, T, D = q.shape
    Hkv = keys.shape[1]
    G = H // Hkv
    R, Sp, C = key_bias.shape[1], key_bias.shape[2], tail_keys.shape[1]
    weights = attention_weights(q, keys, key_bias[:, None])  # (B, Hkv, R, Sp)
    if attention_op.serves(q, keys, values):
        return attention_op.weighted_sums(q, weights, values, shared, tail_keys, tail_select)
    v1 = values.to(work_dtype(q.dtype))
    n = Sp // KEY_CHUNK
    w = (weights * shared[:, None, None]).unflatten(-1, (n, KEY_CHUNK)).transpose(2, 3)  # (B, Hkv, n, R, C)
    chunk_sums = w @ v1.unflatten(2, (n, KEY_CHUNK))  # (B, Hkv, n, R, Dp)
    w = weights.gather(-1, tail_keys[:, None, None].expand(B, Hkv, R, C)).unsqueeze(2) * tail_select[:, None]
    tail_values = v1.gather(2, tail_keys[:, None, :, None].expand(B, Hkv, C, v1.shape[-1])).unsqueeze(2)
    tail_sums = w @ tail_values  # (B, Hkv, n_tail, R, Dp)
    total = torch.cat([chunk_sums, tail_sums], dim=2).cumsum(2)[:, :, -1, :G * T]
    out = total[..., :D] / total[..., D:D + 1]
    return out.unflatten(2, (G, T)).flatten(1, 2).to(q.dtype)


def pool_layer_step(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                    member: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *layout: torch.Tensor
                    ) -> torch.Tensor:
    """One layer of a pass over B slots, one row each: x (B, 1, dim) -> (B, 1, dim).

    cos, sin: (B, 1, 1, D), each row's rotary tables; slots: (B,) long, the cache slot each row is written to (its
    cache's length); member: (B,) 1 for a slot whose row is a call's, 0 for a dummy row, whose slot keeps what it
    holds (the value read there is written back); keys, values: this layer's buffers of the pool cut to the pass's
    first Sp slots (views: the rows are written through them); layout: stack_layouts' four tensors."""
    attention = block.attention
    B, T, _ = x.shape
    q, k, v = attention.project(block.attention_norm(x), cos, sin)
    D = k.shape[-1]
    at = (torch.arange(B, device=x.device)[:, None], torch.arange(k.shape[1], device=x.device)[None], slots[:, None])
    keep = member[:, None, None] > 0
    keys.index_put_(at, torch.where(keep, k[:, :, 0].to(keys.dtype), keys[at]))
    v1 = F.pad(torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1), (0, values.shape[-1] - D - 1))
    values.index_put_(at, torch.where(keep, v1[:, :, 0].to(values.dtype), values[at]))
    y = pool_attention(q, keys, values, *layout)
    x = x + attention.wo(y.transpose(1, 2).reshape(B, T, -1))
    return x + block.feed_forward(block.ffn_norm(x))


pool_layer_region = torch.compiler.nested_compile_region(pool_layer_step)  # traced once, called by every layer


def pool_layers_step(layers: torch.nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slots: torch.Tensor, member: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     *layout: torch.Tensor) -> torch.Tensor:
    """Every layer of a pass over B slots, each a pool_layer_step: x (B, 1, dim) -> (B, 1, dim).

    keys, values: L views, each layer's buffers of the pool cut to the pass's slots and keys (cut outside the graph,
    as compiled.layers_step's); the rest as pool_layer_step's. Compiled, one graph a pass whose layer is one subgraph
    that every layer calls: one call into compiled code and one check of its guards a pass, not one a layer (four
    one-row calls of the demo model: the guards of thirty graphs took 0.9 ms of a 14 ms pass under cProfile)."""
    for i, block in enumerate(layers):
        x = pool_layer_region(block, x, cos, sin, slots, member, keys[i], values[i], *layout)
    return x


def mark_pool_sizes(args: tuple) -> None:
    """Mark the sizes of pool_layers_step's arguments that change from pass to pass dynamic: the slots of the pass
    and the keys they reach."""
    _, x, cos, sin, slots, member, keys, values, key_bias, shared, tail_keys, tail_select = args
    mark_dims([(x, (0,)), (cos, (0,)), (sin, (0,)), (slots, (0,)), (member, (0,)),
               *((t, (0, 2)) for t in keys + values),
               (key_bias, (0, 2)), (shared, (0, 1)), (tail_keys, (0,)), (tail_select, (0,))])


def stack_layouts(layouts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """pool_attention's layout from each slot's one-row graph_layout (key_bias (R, Sp_i), shared (Sp_i,),
    tail_keys (C,), tail_select (n_tail, R, C)): each padded to the widest Sp (hidden and unshared past its own)."""
    Sp = max(layout[0].shape[-1] for layout in layouts)
    key_bias = torch.stack([F.pad(layout[0], (0, Sp - layout[0].shape[-1]), value=-torch.inf) for layout in layouts])
    shared = torch.stack([F.pad(layout[1], (0, Sp - layout[1].shape[-1])) for layout in layouts])
    tail_keys, tail_select = (torch.stack([layout[i] for layout in layouts]) for i in (2, 3))
    return key_bias, shared, tail_keys, tail_select
