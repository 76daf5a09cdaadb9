"""Batch-invariant kernels: a row's result is bitwise independent of how many rows the call has and where it sits.

Lookahead promises exactly the output of plain decoding. A token computed as one row of a wide step must therefore
get the logits it gets in a one-row step, bit for bit; otherwise near-tie argmaxes flip (in bfloat16, often).
Stock kernels break that in two places:
- a weight matmul's row results can depend on the call's row count (BLAS libraries pick kernels and blockings by
  shape). `RowTiledLinear` calls its kernel only on row counts measured to give the same rows (`find_tiling`);
- attention's key reduction depends on the step's layout: SDPA groups keys in blocks, so masked keys between
  visible ones, and where a row's keys split between cache and step, change the rounding. `invariant_attention`
  reduces each row over the keys it sees, counted in order, in fixed chunks merged by a sequential sum.
RMSNorm, rotary embeddings, SiLU and residual adds work row by row already.

The attention is a kernel the model runs in place of its SDPA one (`ExactAttention`, installed by
`apply_exact_attention`), over the cache layout it reads without copying (`PaddedKVCache`). `minilade.device.make_exact`
installs it and the row-tiled linears, and checks at load that the whole model is invariant (one-row step == its
row in a wide step: `check_invariance`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache, huge_page_zeros
from .model import PREFILL_ROWS, SDPAttention, Transformer, step_visibility

KEY_CHUNK = 64  # keys per chunk of attention's reduction; the k-th key a row sees falls in chunk k // KEY_CHUNK
# Attention's matmuls run on row counts that are multiples of ROW_TILE and inner and column counts that are
# multiples of COL_TILE: with fewer, float32 matmuls on an AVX2 CPU (torch 2.13) take other kernels (torch's own loop
# below 400 multiply-adds, BLAS edge kernels) that round a row differently; with these, rows and columns came out
# bitwise equal whatever the call's size (measured; the load-time check in device.py verifies the whole model on
# the machine it runs on).
ROW_TILE = 4
COL_TILE = 16
# On a CUDA GPU (H200, torch 2.11's cuBLAS) rows and keys in tiles of 4 and 16 still let a row's attention depend on
# the step's shape; in tiles of 64 rows and 64 keys the whole-model check passes, float32 and bfloat16, LLaMA-7B
# shapes (measured: scripts/bench/cuda.py). A GPU's matmul costs the same at 1 row as at 64.
GPU_TILE = 64


def attention_tiles(device: torch.device | str) -> tuple[int, int]:
    """(rows, keys): attention's query rows and (uncut) key slots are padded to multiples of these on a device."""
    return (ROW_TILE, COL_TILE) if torch.device(device).type == "cpu" else (GPU_TILE, GPU_TILE)


LOG2_E = 1.4426950408889634  # attention's scores are scaled by it and exponentiated in base 2
# Raised whenever the step's kernels change (how they round, or what they cost): what a machine keeps about them
# (step costs, invariance verdicts: decoding/step_costs.cost_key) is then measured again. 2: base-2 softmax;
# 3: reduced-precision matmuls on the CPU on two rows at least (REDUCED_MIN_ROWS); 4: scores summed over the head
# width in pieces (key_scores); 5: native steps' attention on AVX2 in two registers a value (what a row costs there).
KERNELS_VERSION = 5


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Attention computes reduced-precision inputs in float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


@dataclass(frozen=True)
class KeyLayout:
    """What every layer's attention in one step shares: which keys each row sees and which chunk each falls in.

    Rows are the step's T query rows for each of the G query heads of a key head, G*T, padded to `rows`; keys are
    the cache and the step, S = past + T, padded to `keys`. key_bias: (rows, keys) in attention's work dtype, -inf
    where a row does not see a key and 0 where it does (added to the scores: far cheaper than masked_fill on a
    CPU, and the same bits, since score + 0 == score). A row counts the keys of its own sequence (the committed
    cache and the step rows its mask allows), in slot order; the k-th falls in chunk k // chunk. It sees those a
    sliding window leaves (all, without one): a counted key it does not see weighs 0 in its chunk, so the chunks
    are the same in a wide step and in a one-row step at the row's position. The first n_shared chunks are cut
    by slot: a row counts either all of a shared chunk's keys or, past its own end, none.
    tail_select: None when every row counts a prefix of the slots (a causal step: slot order is counting order,
    every chunk is shared); else (n_tail, rows, keys - L0), 1 where a row sees a key of the tail [L0, keys) that
    falls in its tail chunk j, L0 = n_shared * chunk (a lookahead step, whose rows skip keys).
    """

    past: int
    T: int
    rows: int
    keys: int
    n_shared: int
    chunk: int
    key_bias: torch.Tensor
    tail_select: torch.Tensor | None


def sees_a_prefix(keys: torch.Tensor) -> bool:
    """keys: (T, S) bool. True when every row has slots [0, n) for some n: no False before a True."""
    return bool(keys[:, 0].all()) and not bool((keys[:, 1:] & ~keys[:, :-1]).any())


def key_layout(visible: torch.Tensor, past: int, G: int, dtype: torch.dtype, chunk: int = KEY_CHUNK,
               counted: torch.Tensor | None = None) -> KeyLayout:
    """visible: (T, past + T) bool, the keys each row sees; counted: the keys each row counts (step_visibility
    without the sliding window; None: visible); G query heads per key head; dtype: the model's."""
    T, S = visible.shape
    prefix = sees_a_prefix(visible if counted is None else counted)
    row_tile, key_tile = attention_tiles(visible.device)
    R, Sp = round_up(G * T, row_tile), round_up(S, chunk if prefix else key_tile)

    def per_row(keys: torch.Tensor) -> torch.Tensor:  # (R, Sp): G copies of each row, padding rows copy row 0
        keys = keys.repeat(G, 1)
        return F.pad(torch.cat([keys, keys[:1].expand(R - G * T, S)]), (0, Sp - S))

    seen = per_row(visible)
    key_bias = torch.zeros(seen.shape, dtype=work_dtype(dtype), device=seen.device).masked_fill_(~seen, -torch.inf)
    if prefix:
        return KeyLayout(past, T, R, Sp, Sp // chunk, chunk, key_bias, None)
    n_shared = past // chunk
    tail_seen = seen[:, n_shared * chunk:]
    tail_counted = tail_seen if counted is None else per_row(counted)[:, n_shared * chunk:]
    tail_chunk = (tail_counted.cumsum(-1) - 1).div_(chunk, rounding_mode="floor").masked_fill_(~tail_seen, -1)
    n_tail = int(tail_chunk.max()) + 1
    select = tail_chunk == torch.arange(n_tail, device=visible.device)[:, None, None]
    return KeyLayout(past, T, R, Sp, n_shared, chunk, key_bias, select.to(work_dtype(dtype)))


def value_columns(D: int) -> int:
    """Columns of the values attention multiplies: D, a column of ones that sums the weights, zeros to a tile."""
    return round_up(D + 1, COL_TILE)


class PaddedKVCache(KVCache):
    """The KV cache invariant_attention reads without copying.

    k: (n_layers, B, Hkv, slots, D), v: (n_layers, B, Hkv, slots, value_columns(D)), slots = capacity rounded up to
    KEY_CHUNK, two chunks at least, and one spare chunk after: a step's keys never fill the buffer, so the views of it
    that compiled steps are handed all have the same kind of strides (saved_graphs.SavedGraphs traces a graph once for
    every later step). v's column D is all ones (it sums the attention weights) and the columns after it zero. Kept
    in attention's work dtype (bfloat16 keys and values stored exactly in float32, read without a copy). Slots never
    written hold zeros, so every slot is finite (a hidden key weighs exactly 0).
    """

    def allocate(self, config: ModelConfig, capacity: int, batch_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        slots = round_up(max(capacity, 2 * KEY_CHUNK), KEY_CHUNK) + KEY_CHUNK  # (compiled.graph_layout, SavedGraphs)
        D, shape = config.head_dim, (config.n_layers, batch_size, config.n_kv_heads, slots)
        k = huge_page_zeros((*shape, D), work_dtype(dtype), device)
        v = huge_page_zeros((*shape, value_columns(D)), work_dtype(dtype), device)
        v[..., D] = 1
        return k, v

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As KVCache.write; the values go to the first D columns."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end, :self.head_dim] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end, :self.head_dim]


def padded_views(cache: KVCache, layer: int, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (B, Hkv, n_slots, D) and values with their extra columns (B, Hkv, n_slots, value_columns(D)),
    including slots past those written (finite, to be hidden by the caller): views of a PaddedKVCache, a padded
    copy of a plain KVCache."""
    if isinstance(cache, PaddedKVCache):
        return cache.k[layer, :, :, :n_slots], cache.v[layer, :, :, :n_slots]
    end = min(n_slots, cache.capacity)
    return pad_keys_values(cache.k[layer, :, :, :end], cache.v[layer, :, :, :end], n_slots)


def pad_keys_values(keys: torch.Tensor, values: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values: (B, Hkv, S, D) -> keys (B, Hkv, n_slots, D) and values (B, Hkv, n_slots, value_columns(D)),
    zero-padded, values with their column of ones: the layout a PaddedKVCache keeps."""
    B, Hkv, S, D = values.shape
    ones = values.new_ones(B, Hkv, S, 1)
    v1 = F.pad(torch.cat([values, ones], dim=-1), (0, value_columns(D) - D - 1, 0, n_slots - S))
    return F.pad(keys, (0, 0, 0, n_slots - S)), v1


# Scores sum a row's products over the head width in pieces of this many columns, added in order: on an AVX-512
# Xeon (torch 2.13's MKL), a float32 matmul over 128 or more columns rounds a call of 4 rows (8 over 256) unlike a
# wider one, which it does not over 64 (measured); a piece's sum is then the same at every row count.
SCORE_COLUMNS = 64


def key_scores(qs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """qs (..., R, D) @ k (..., S, D)^T -> (..., R, S): each score summed over D in pieces of SCORE_COLUMNS columns,
    the pieces' matmuls added in order (one matmul where D is at most SCORE_COLUMNS)."""
    kt = k.transpose(-1, -2)
    scores = qs[..., :SCORE_COLUMNS] @ kt[..., :SCORE_COLUMNS, :]
    for d in range(SCORE_COLUMNS, qs.shape[-1], SCORE_COLUMNS):
        scores = scores + qs[..., d:d + SCORE_COLUMNS] @ kt[..., d:d + SCORE_COLUMNS, :]
    return scores


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: KeyLayout
                        ) -> torch.Tensor:
    """Softmax attention whose every row depends only on the keys that row sees, in slot order.

    q: (B, H, T, D); keys: (B, Hkv, layout.keys, D), values: (B, Hkv, layout.keys, value_columns(D)), the cache
    and then the step's rows, past + T slots, then slots the layout hides (finite), values with their column of
    ones (padded_views). Returns (B, H, T, D) in q's dtype.

    Row r's counted keys (see KeyLayout), in slot order, are numbered 0, 1, ...; in a causal or lookahead step that
    is position order, the same sequence a one-row step at r's position sees. Key k falls in chunk k // chunk.
    Scores use the row's exact maximum; each chunk's weighted sum of values (and of weights: a column of ones) is
    one matmul in which hidden keys weigh exactly 0; the chunk sums are then added in order by one sequential scan.
    Shared chunks (cut by slot) are computed together by one batched matmul; each tail chunk by one matmul over the
    whole tail, the keys of other chunks zeroed.
    """
    B, H, T, D = q.shape
    Hkv = keys.shape[1]
    G, R, C = H // Hkv, layout.rows, layout.chunk
    work = work_dtype(q.dtype)
    # Heads under their key head; scores in base 2 (log2(e) folded into the scale): exp2 costs a quarter of exp on
    # a CPU (torch 2.13, measured) and softmax is the same function in either base.
    qs = F.pad(q.reshape(B, Hkv, G * T, D).to(work) * (D ** -0.5 * LOG2_E), (0, 0, 0, R - G * T))
    k, v1 = keys.to(work), values.to(work)  # no copy when the cache keeps the work dtype
    scores = key_scores(qs, k).add_(layout.key_bias)  # (B, Hkv, R, keys)
    weights = scores.sub_(scores.amax(-1, keepdim=True)).exp2_()  # in place; exactly 0 where hidden

    n, L0 = layout.n_shared, layout.n_shared * C
    w = weights[..., :L0].unflatten(-1, (n, C)).transpose(2, 3)  # (B, Hkv, n, R, C)
    chunk_sums = w @ v1[:, :, :L0].unflatten(2, (n, C))  # (B, Hkv, n, R, Dp)
    if layout.tail_select is not None:
        w = weights[..., L0:].unsqueeze(2) * layout.tail_select  # (B, Hkv, n_tail, R, keys - L0)
        chunk_sums = torch.cat([chunk_sums, w @ v1[:, :, L0:].unsqueeze(2)], dim=2)
    # A scan adds the chunks one after another, in order, whatever their number (a trailing chunk a row does not
    # reach adds exact zeros); a sum() reduction would group them by the count.
    total = chunk_sums.cumsum(2)[:, :, -1, :G * T]  # (B, Hkv, G*T, value_columns(D))
    out = total[..., :D] / total[..., D:D + 1]
    return out.reshape(B, H, T, D).to(q.dtype)


class CausalPrefill:
    """A causal step over an empty cache (a prompt's prefill). Its query rows attend in blocks of PREFILL_ROWS, each
    laid out as a causal step after the rows before it: a row's result does not depend on the step it is computed
    in, and the scores held at once grow with the block times the prompt, not the prompt squared. The layouts are
    made at the first layer, which knows the row count, and serve every layer."""

    def __init__(self, groups: int, dtype: torch.dtype) -> None:
        self.groups, self.dtype = groups, dtype
        self.blocks: list[KeyLayout] | None = None

    def layouts(self, T: int, device: torch.device) -> list[KeyLayout]:
        if self.blocks is None:
            self.blocks = [key_layout(step_visibility(None, start, min(PREFILL_ROWS, T - start), device), start,
                                      self.groups, self.dtype) for start in range(0, T, PREFILL_ROWS)]
        return self.blocks


class ExactAttention(SDPAttention):
    """The model's attention kernel for exact lookahead: every step's rows through invariant_attention, a prompt's
    prefill too. A row's K/V and output then depend only on the tokens up to it, never on how a prompt was split
    between passes (a server that reuses a kept prompt prefix prefills only the rest: minilade/serve).

    prepare makes the step's KeyLayout once for all layers (a prefill's at its first layer: CausalPrefill).
    groups: query heads per key head.
    """

    cache_type = PaddedKVCache

    def __init__(self, groups: int) -> None:
        self.groups = groups

    def prepare(self, visible: torch.Tensor | None, reach: torch.Tensor | None, past: int, dtype: torch.dtype
                ) -> KeyLayout | CausalPrefill:
        """visible, reach: Transformer.step_masks (visible None: causal over an empty cache); dtype: the model's."""
        if visible is None:
            return CausalPrefill(self.groups, dtype)
        return key_layout(visible, past, self.groups, dtype, counted=reach)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                 step: KeyLayout | CausalPrefill) -> torch.Tensor:
        cache.write(layer, k, v)
        if isinstance(step, CausalPrefill):
            blocks = step.layouts(q.shape[2], q.device)
            return torch.cat([invariant_attention(q[:, :, b.past:b.past + b.T], *padded_views(cache, layer, b.keys), b)
                              for b in blocks], dim=2)
        return invariant_attention(q, *padded_views(cache, layer, step.keys), step)


def apply_exact_attention(model: Transformer) -> Transformer:
    """Install ExactAttention as the model's attention kernel (its caches then come padded). The weight matmuls
    are made invariant, and the whole model checked, by minilade.device.make_exact."""
    model.attention_kernel = ExactAttention(model.config.n_heads // model.config.n_kv_heads)
    return model


# ---- weight matmuls in fixed row tiles ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RowTiling:
    """How a weight matmul is called so that a row's result never depends on the call's row count.

    rows: every call gets at least this many rows (fewer are padded with zero rows). split: calls of exactly
    `rows` rows each, the last one padded, for kernels whose rows change with the row count even above `rows`.
    packed: use oneDNN's prepacked weight instead of F.linear.
    """

    rows: int = 1
    split: bool = False
    packed: bool = False

    def __str__(self) -> str:
        return f"{'packed' if self.packed else 'plain'} rows {'=' if self.split else '>='} {self.rows}"


# Tried in this order (cheapest padding first); the first whose rows come out the same at every row count wins.
TILINGS = [RowTiling(t) for t in (1, 2, 4, 8, 16)] + [RowTiling(t, split=True) for t in (4, 8, 16, 32)]
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64)
# The first PROBE_ALONE rows of the probe are also checked one by one: a one-row kernel may round differently only
# now and then, which single rows at two offsets missed (bfloat16 on an AVX512-BF16 CPU: caught on 5 of 10 seeds
# without this check, 20 of 20 with 32 rows alone; measured).
PROBE_ALONE = 32
# A one-row bfloat16 matmul on the CPU can round a row as no wider call does, for some inputs only: on a Xeon with
# AMX (torch 2.11) one logit of a real activation came out other at 1 row than at 2-40 rows, where the probe's
# random inputs agreed at every count. Reduced-precision weights on the CPU are therefore never called on fewer rows.
REDUCED_MIN_ROWS = 2


def tiled_matmul(x: torch.Tensor, kernel, tiling: RowTiling) -> torch.Tensor:
    """kernel applied to x: (..., K) -> (..., N), its rows padded or split as the tiling says."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    target = round_up(rows, tiling.rows) if tiling.split else max(rows, tiling.rows)
    if target > rows:
        flat = F.pad(flat, (0, 0, 0, target - rows))
    if tiling.split and target > tiling.rows:
        y = torch.cat([kernel(tile) for tile in flat.split(tiling.rows)])
    else:
        y = kernel(flat)
    return y[:rows].view(*x.shape[:-1], y.shape[-1])


def linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """x (M, K) -> (M, N): F.linear, or oneDNN's matmul on a prepacked copy of the weight."""
    if packed is None:
        return lambda x: F.linear(x, weight, bias)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def find_tiling(weight: torch.Tensor, packed: bool, seed: int = 0) -> RowTiling | None:
    """The first tiling under which every row comes out bitwise the same whatever the call's row count and the
    row's place in it (PROBE_ROWS counts at several offsets, and the first PROBE_ALONE rows alone), or None.

    The probe multiplies random inputs by a random weight of `weight`'s shape and dtype, not by `weight` itself:
    the kernel a call takes depends on shape, dtype and layout, not on values, and real values can hide a change
    of summation order (zeros; dequantized codes whose products add up exactly). The inputs are normal numbers
    scaled by powers of two from 2^-6 to 2^6, so that partial sums round differently in any other order. In
    bfloat16 the sums are rounded to 8 bits on the way out, which hides most of an order's difference: a probe
    with the real weight and unscaled inputs passed a one-row kernel of a bfloat16 model that rounded rows of
    the real model differently (AVX512-BF16 CPU, measured: docs/history.md)."""
    gen = torch.Generator().manual_seed(seed)
    probe_weight = torch.randn(weight.shape, generator=gen).to(weight.device, weight.dtype)
    x = torch.randn(2 * max(PROBE_ROWS), weight.shape[1], generator=gen)
    x = (x * torch.exp2(torch.randint(-6, 7, x.shape, generator=gen).float())).to(weight.device, weight.dtype)
    kernel = linear_kernel(probe_weight, None, prepack(probe_weight) if packed else None)
    with torch.inference_mode():
        for tiling in TILINGS:
            if tiling.rows < REDUCED_MIN_ROWS and weight.dtype in (torch.bfloat16, torch.float16) \
                    and weight.device.type == "cpu":
                continue
            tiling = RowTiling(tiling.rows, tiling.split, packed)
            whole = tiled_matmul(x, kernel, tiling)
            if (all(torch.equal(tiled_matmul(x[at:at + M], kernel, tiling), whole[at:at + M])
                    for M in PROBE_ROWS for at in (0, M))
                    and all(torch.equal(tiled_matmul(x[r:r + 1], kernel, tiling), whole[r:r + 1])
                            for r in range(PROBE_ALONE))):
                return tiling
    return None


class RowTiledLinear(nn.Module):
    """A linear layer whose every call runs under one RowTiling, so each row's result is row-count invariant."""

    def __init__(self, linear: nn.Linear, tiling: RowTiling) -> None:
        super().__init__()
        self.weight, self.bias, self.tiling = linear.weight, linear.bias, tiling
        self.packed = prepack(linear.weight) if tiling.packed else None
        # In a compiled graph (compiled.py) the layer is F.linear on at least graph_rows rows (padding rows added),
        # the unpacked kernel's tiling: inductor does not call the prepacked kernel.
        self.graph_rows = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self.graph_rows == 1:
                return F.linear(x, self.weight, self.bias)
            rows = x.reshape(-1, x.shape[-1])  # graph_rows - 1 padding rows: no row count, so no graph, is special
            y = F.linear(F.pad(rows, (0, 0, 0, self.graph_rows - 1)), self.weight, self.bias)
            return y[:rows.shape[0]].view(*x.shape[:-1], y.shape[-1])
        kernel = linear_kernel(self.weight, self.bias, self.packed)
        if not self.tiling.split and x.numel() >= self.tiling.rows * x.shape[-1]:
            return kernel(x)  # rows enough for the tiling: the kernel as it is (it flattens leading dimensions)
        return tiled_matmul(x, kernel, self.tiling)
