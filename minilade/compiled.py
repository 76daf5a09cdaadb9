"""Decoding steps of any shape as compiled graphs: the same exact step, with its small operations fused.

An eager decoding step of `Transformer.forward` dispatches some 2,000 small operations (norms, rotary, the
batch-invariant attention's pieces, casts around quantized matmuls), which on a CPU take longer than the weight
matmuls of a quantized model (docs/benchmarks.md). `compile_steps(model)` installs `CompiledSteps` as the model's
`step_runner`: every step after the prefill, of any strategy and any row count, then runs its layers as one graph
compiled by torch.compile (inductor), in which one compiled layer is called by every layer with its own weights and
cache; the graph serves every row count (dynamic shapes; a one-row step gets a graph of its own, as inductor
specialises sizes of 1).

Exactness is kept by construction, as in the eager step: each layer computes the batch-invariant attention of
invariance.py (the same KeyLayout, built once per step on the host), written with shapes that do not change the
order of any row's sums (`chunked_attention`); weight matmuls are inductor's external calls, one call per weight
over all rows, whose rows the load-time check (device.check_invariance, run through this runner) finds the same at
every row count. A compiled step does not round as the eager step does (inductor fuses and vectorises its own
element-wise code), so a model runs all its steps compiled or none: greedy lookahead and auto then give plain
decoding's output through compiled steps, as they do eagerly. Where the C++ operator of attention_op.py is loaded
(float32 steps), each layer's attention ends with it: the chunks' weighted sums of the values in one operator, in
an order of its own that is the same for a row at every width (step_attention).
"""

from __future__ import annotations

import functools
import sys
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import attention_op
from .decoding.step_costs import cost_key
from .errors import one_line
from .frame_stack import on_fresh_frame_chunk
from .integer_linear import W7A8Linear, load_native_matmul, pack_layers
from .invariance import (
    KEY_CHUNK,
    LOG2_E,
    KeyLayout,
    PaddedKVCache,
    RowTiledLinear,
    apply_exact_attention,
    find_tiling,
    key_layout,
    key_scores,
    round_up,
    work_dtype,
)
from .kv_cache import KVCache
from .model import Block, Transformer
from .saved_graphs import SavedGraphs, modes_kind, traced_code_digest, tracing_config


def chunked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor,
                      shared: torch.Tensor, tail_keys: torch.Tensor, tail_select: torch.Tensor) -> torch.Tensor:
    """invariance.invariant_attention with every size a tensor's, so that one graph serves every step.

    q: (B, H, T, D); keys: (B, Hkv, Sp, D), values: (B, Hkv, Sp, value_columns(D)), Sp a multiple of KEY_CHUNK;
    the step's layout (graph_layout): key_bias (R, Sp), 0 where a row sees a key and -inf elsewhere; shared (Sp,),
    1 on the shared chunks' slots [0, L0) and 0 after; tail_keys (Sp - L0,) long, the slots [L0, Sp); tail_select
    (n_tail, R, Sp - L0), 1 where a row counts a tail key in its tail chunk j. Returns (B, H, T, D) in q's dtype.

    The shared chunks are all Sp / KEY_CHUNK chunks of the slots, those past L0 weighing exactly 0, and the tail
    chunks follow: the scan adds the same non-zero chunk sums in the same order as invariant_attention does, and
    each chunk sum is one matmul over its keys in slot order, hidden keys weighing exactly 0.
    """
    B, H, T, D = q.shape
    G = H // keys.shape[1]
    Sp = key_bias.shape[-1]
    weights = attention_weights(q, keys, key_bias)  # (B, Hkv, R, Sp)
    v1 = values.to(work_dtype(q.dtype))
    n = Sp // KEY_CHUNK
    w = (weights * shared).unflatten(-1, (n, KEY_CHUNK)).transpose(2, 3)  # (B, Hkv, n, R, C)
    chunk_sums = w @ v1.unflatten(2, (n, KEY_CHUNK))  # (B, Hkv, n, R, Dp)
    w = weights.index_select(-1, tail_keys).unsqueeze(2) * tail_select  # (B, Hkv, n_tail, R, Sp - L0)
    tail_sums = w @ v1.index_select(2, tail_keys).unsqueeze(2)  # (B, Hkv, n_tail, R, Dp)
    total = torch.cat([chunk_sums, tail_sums], dim=2).cumsum(2)[:, :, -1, :G * T]
    out = total[..., :D] / total[..., D:D + 1]
    # (B, H, T, D) as a split of the rows then a merge of the heads, not one reshape: the code that reads it (wo's
    # input rounding) then finds each element by constant divisions, not by divisions by the step's dynamic sizes
    # (4.5 of 28 ms of a 32-row step of the demo model; the same bits either way).
    return out.unflatten(2, (G, T)).flatten(1, 2).to(q.dtype)


def attention_weights(q: torch.Tensor, keys: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
    """The softmax numerators of chunked_attention: q (B, H, T, D), keys (B, Hkv, Sp, D), key_bias (B|1, R, Sp) or
    (R, Sp) -> (B, Hkv, R, Sp) in the work dtype, exactly 0 where a row does not see a key. Row g * T + t of key-value
    head h is query head h * G + g's row t; rows past G * T are padding (R is the layout's)."""
    B, H, T, D = q.shape
    Hkv = keys.shape[1]
    G = H // Hkv
    R = key_bias.shape[-2]
    work = work_dtype(q.dtype)
    qs = F.pad(q.reshape(B, Hkv, G * T, D).to(work) * (D ** -0.5 * LOG2_E), (0, 0, 0, R - G * T))
    scores = key_scores(qs, keys.to(work)) + key_bias  # (B, Hkv, R, Sp)
    return (scores - scores.amax(-1, keepdim=True)).exp2()


def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, *step_layout: torch.Tensor) -> torch.Tensor:
    """A layer's attention in a step: the rows' keys and values written into the cache, then step_attention.

    q: (B, H, T, D); k, v: (B, Hkv, T, D); slots: (T,) long, the cache slots the rows are written to
    (cache.length + arange(T)); keys, values: this layer's buffers of a PaddedKVCache cut to the step's first Sp
    slots (views: the rows are written through them into the cache), (B, Hkv, Sp, D) and (B, Hkv, Sp,
    value_columns(D)); step_layout: graph_layout's tensors, over those Sp slots. Returns (B, H, T, D)."""
    D = k.shape[-1]
    keys.index_copy_(2, slots, k.to(keys.dtype))
    ones = v.new_ones(*v.shape[:-1], 1)
    values.index_copy_(2, slots, F.pad(torch.cat([v, ones], -1), (0, values.shape[-1] - D - 1)).to(values.dtype))
    return step_attention(q, keys, values, *step_layout)


def step_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor,
                   shared: torch.Tensor, tail_keys: torch.Tensor, tail_select: torch.Tensor) -> torch.Tensor:
    """chunked_attention's sums (its arguments and result), ended by the C++ operator where it is loaded and the step
    computes in float32 (attention_op.py: the chunks' sums of the values, in one operator), else
    chunked_attention. The two round each their own way, and each gives a row the same bits at every width of
    step."""
    if not attention_op.serves(q, keys, values):
        return chunked_attention(q, keys, values, key_bias, shared, tail_keys, tail_select)
    return attention_op.weighted_sums(q, attention_weights(q, keys, key_bias), values, shared[None], tail_keys[None],
                                      tail_select[None])


def layer_step(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, *step_layout: torch.Tensor) -> torch.Tensor:
    """One layer of a decoding step: x (B, T, dim) -> (B, T, dim), its keys and values written into the cache.

    cos, sin: (B|1, T, 1, D) the rows' rotary tables; the rest as layer_attention takes them. (The cache views are
    cut outside the graph: a slice's length inside it depends on whether Sp reaches the cache's end, which the graph
    would guard on.)
    """
    attention = block.attention
    B, T, _ = x.shape
    q, k, v = attention.project(block.attention_norm(x), cos, sin)
    y = layer_attention(q, k, v, slots, keys, values, *step_layout)
    x = x + attention.wo(y.transpose(1, 2).reshape(B, T, -1))
    return x + block.feed_forward(block.ffn_norm(x))


layer_region = torch.compiler.nested_compile_region(layer_step)  # traced once, called by every layer


def layers_step(layers: torch.nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                *step_layout: torch.Tensor) -> torch.Tensor:
    """Every layer of a decoding step, each a layer_step: x (B, T, dim) -> (B, T, dim).

    keys, values: L views, each layer's cache buffers cut to the step's first Sp slots, as layer_step takes them
    (cut outside the graph, one by one: where the subgraph wrote into views it selected from one (L, ...) view,
    torch 2.13 wrote every layer's rows into the first layer's); the rest as layer_step's. Compiled, this is one
    graph a step, not one a layer, in which the layer is one subgraph (layer_region) that each layer calls with
    its own weights and cache: one call into compiled code a step instead of L, measured 20% faster on a one-row
    step of the demo model (docs/benchmarks.md)."""
    for i, block in enumerate(layers):
        x = layer_region(block, x, cos, sin, slots, keys[i], values[i], *step_layout)
    return x


def pass_layer_step(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    *calls: torch.Tensor) -> torch.Tensor:
    """One layer of a pass over the steps of several generations, each over its own cache: x (1, sum T_i, dim) ->
    (1, sum T_i, dim), each call's keys and values written into its own cache.

    The rows of every call go through the layer's norms and weight matmuls together (one read of the weights for
    all), and each call's rows attend over its own cache with its own layout (layer_attention). calls: CALL_INPUTS
    tensors per call, in the order of its rows in x: its slots (T_i,), this layer's keys and values views of its
    cache and its graph_layout, as layer_attention takes them; cos, sin: (1, sum T_i, 1, D). Row by row these are
    the operations of each call's own step, with the same weight matmuls (row-count invariant), so each call's rows
    get its step's bits; serve/compiled_pass.py checks that against each call alone before using it. (Each call's
    attention is traced inline: as one nested subgraph that every call runs, the graph demands that every call's
    sizes equal the first's.)"""
    attention = block.attention
    B, T, _ = x.shape
    q, k, v = attention.project(block.attention_norm(x), cos, sin)
    ys, start = [], 0
    for i in range(0, len(calls), CALL_INPUTS):
        slots, keys, values, *step_layout = calls[i:i + CALL_INPUTS]
        rows = slice(start, start + slots.shape[0])
        ys.append(layer_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], slots, keys, values, *step_layout))
        start += slots.shape[0]
    y = torch.cat(ys, dim=2)
    x = x + attention.wo(y.transpose(1, 2).reshape(B, T, -1))
    return x + block.feed_forward(block.ffn_norm(x))


CALL_INPUTS = 7  # per call of a pass: slots, keys, values and graph_layout's four tensors


def mark_pass_sizes(args: tuple) -> None:
    """mark_dynamic_sizes for pass_layer_step's arguments: the rows of the pass and of each call, each call's keys and
    its layout."""
    _, x, cos, sin, *calls = args
    marks = [(x, (1,)), (cos, (1,)), (sin, (1,))]
    for i in range(0, len(calls), CALL_INPUTS):
        slots, keys, values, *step_layout = calls[i:i + CALL_INPUTS]
        marks += [(slots, (0,)), (keys, (2,)), (values, (2,)), *((t, range(t.dim())) for t in step_layout)]
    mark_dims(marks)


def mark_dynamic_sizes(args: tuple) -> None:
    """Mark every size of layers_step's arguments that changes from step to step as dynamic (rows, the keys in the
    layout and its tail; sizes of 1 stay static, as inductor specialises them), so that the first step of a kind
    traces the graph every later step of that kind runs. Weights keep static sizes: a graph is a model's own."""
    _, x, cos, sin, slots, keys, values, *step_layout = args
    mark_dims([(x, (1,)), (cos, (1,)), (sin, (1,)), (slots, (0,)), *((t, (2,)) for t in keys + values),
               *((t, range(t.dim())) for t in step_layout)])


def mark_dims(marks: list) -> None:
    """Mark the given dimensions of each tensor, (tensor, dims) pairs, dynamic; sizes of 1 stay static, as inductor
    specialises them."""
    for tensor, dims in marks:
        for dim in dims:
            if tensor.shape[dim] > 1:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


@functools.cache
def compiled_layers_step() -> Callable[..., torch.Tensor]:
    """layers_step under torch.compile, shared by every model: used where no folder keeps the graphs (SavedGraphs
    does; a later process then traces each graph again, inductor's disk cache notwithstanding). A graph is kept per
    model (its weights' sizes), dtype and one-row or wider step; dynamo's default of 8 graphs a function is raised
    to hold them (past it, fullgraph fails loudly). The graph's host code is inductor's Python wrapper: its C++ one
    cannot call a subgraph."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(layers_step, fullgraph=True)

    def run(*args: torch.Tensor) -> torch.Tensor:
        mark_dynamic_sizes(args)
        with tracing_config():
            return compiled(*args)

    return run


class CompiledSteps:
    """A model's step_runner: Transformer.forward hands it every step with committed cache rows.

    The step's layout is made once on the host (invariance.key_layout, as the eager exact kernel makes it), then
    the layers run as one graph (layers_step); the embedding lookup, the final norm and the output head (one matmul
    over the rows read) stay eager, and they are the same for every row count.
    """

    runs_prefill = False  # a prompt's prefill runs eagerly (Transformer.forward)

    def __init__(self, model: Transformer, graphs: Path | None = None) -> None:
        """graphs: a folder to keep the graphs in between processes (SavedGraphs); None: traced in this process."""
        self.groups = model.config.n_heads // model.config.n_kv_heads
        self.graphs = graphs
        self.run_layers: Callable[..., torch.Tensor] | None = None if graphs is not None else compiled_layers_step()
        self.layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per cache: layer_views

    @property
    def name(self) -> str:
        """In the keys under which step costs, verdicts and graphs are kept (step_costs.cost_key): the digest of the
        code the graphs are traced from (a verdict holds for the code it checked), and whether they attend through
        the C++ operator (its rounding is its own)."""
        return f"compiled {traced_code_digest()[:12]}{' attention op' if attention_op.loaded() else ''}"

    def __call__(self, model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache,
                 mask: torch.Tensor | None, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """As Transformer.forward (input_pos (B|1, T)); cache: a PaddedKVCache with cache.length > 0. The step's
        host code calls Python for every weight matmul: it runs from a fresh chunk of the frame stack, whoever
        calls (frame_stack.py)."""
        return on_fresh_frame_chunk(self.step, model, tokens, input_pos, cache, mask, logits_rows)

    def layer_views(self, cache: KVCache, n_slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's keys (B, Hkv, n_slots, D) and values (B, Hkv, n_slots, value_columns(D)) of a PaddedKVCache,
        as layers_step takes them: views of the cache's memory, each layer's over a storage of its own.

        The memory is the cache's, only the storage objects new (torch.from_numpy): views of one buffer tell the
        compiler that the 2L inputs a step writes into may overlap, and its alias analysis of them (symbolic in the
        slots) took half of a graph's compile time, 82 s against 40 s a graph of the demo model. Layers never
        overlap, so nothing is hidden that the graph relies on. The storages are kept per cache, the views cut anew
        each step (a view a graph was compiled from keeps dynamo's marks, which other graphs' guards refuse)."""
        if cache not in self.layers:
            with torch.inference_mode(False):  # tensors of the same kind whichever mode the first step runs in
                self.layers[cache] = tuple([torch.from_numpy(t) for t in b.numpy()] for b in (cache.k, cache.v))
        keys, values = self.layers[cache]
        return [t.narrow(2, 0, n_slots) for t in keys], [t.narrow(2, 0, n_slots) for t in values]

    def step(self, model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache,
             mask: torch.Tensor | None, logits_rows: torch.Tensor | None) -> torch.Tensor:
        x = self.layers_runner(model)(*self.layers_inputs(model, tokens, input_pos, cache, mask))
        if logits_rows is not None:
            x = x[:, logits_rows]
        return model.output(model.norm(x))

    def layers_runner(self, model: Transformer) -> Callable[..., torch.Tensor]:
        """What runs layers_step: the SavedGraphs of this model where a folder keeps its graphs, made when first
        asked for (its key names this runner, which is installed after __init__)."""
        if self.run_layers is None:
            self.run_layers = SavedSteps(self.graphs, cost_key(model))
        return self.run_layers

    def layers_inputs(self, model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache,
                      mask: torch.Tensor | None) -> tuple:
        """The step's host code: layers_step's arguments for a step of `tokens` (B, T) (the embedded rows, their
        rotary tables, the cache slots they go to, each layer's cache views and the step's layout)."""
        T, past = tokens.shape[1], cache.length
        cos, sin = model.rotary(input_pos)
        step_layout = self.step_layout(model, input_pos, past, mask)
        slots = torch.arange(past, past + T, device=tokens.device)
        # Strides made from the sizes alone: a size-1 dimension's stride is whatever the view that made the tensor
        # left, and a saved graph guards on it (x.stride()[0] in a wide step's graph).
        x = model.tok_embeddings(tokens).to(model.dtype).clone(memory_format=torch.contiguous_format)
        cos, sin = (t.clone(memory_format=torch.contiguous_format) for t in (cos, sin))
        keys, values = self.layer_views(cache, step_layout[0].shape[-1])
        return model.layers, x, cos, sin, slots, keys, values, *step_layout

    def step_layout(self, model: Transformer, input_pos: torch.Tensor, past: int, mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, ...]:
        """graph_layout of a step of rows at input_pos (1, T) over `past` committed rows, with its mask (T, T) or
        None (causal): the keys each row sees, as the eager exact kernel lays them out (invariance.key_layout)."""
        visible, reach = model.step_masks(mask, past, input_pos.shape[-1], input_pos)
        return graph_layout(key_layout(visible, past, self.groups, model.dtype, counted=reach))


class SavedSteps(SavedGraphs):
    """layers_step's graphs kept in a folder (SavedGraphs), one a kind of step: one row or several
    (compile_policy.compile_kinds_at_once compiles the two at once). A step the saved graph's guards refuse runs
    through compiled_layers_step, traced here."""

    def __init__(self, folder: Path, key: str) -> None:
        super().__init__(folder, key, layers_step, mark_dynamic_sizes)

    @staticmethod
    def kind(rows: int) -> str:
        """The kind of graph that serves a step of `rows` rows in the current autograd and inference modes."""
        return modes_kind(f"{'one-row' if rows == 1 else 'wider'} steps")

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        kind = self.kind(args[1].shape[1])
        graph = self.graph(kind, args)
        try:
            return graph(*args)
        except RuntimeError as error:
            if "GuardManager check failed" not in str(error):
                raise
            # Not met in the tests, but possible (other relations between sizes than at tracing): the rest of this
            # kind's steps run through one graph traced here, so that steps keep one rounding from this one on.
            print(f"minilade: the saved graph for {kind} refuses this one ({one_line(error)[:200]}); tracing it here",
                  file=sys.stderr)
            self.graphs[kind] = compiled_layers_step()
            return self.graphs[kind](*args)


def graph_layout(layout: KeyLayout) -> tuple[torch.Tensor, ...]:
    """chunked_attention's key_bias, shared, tail_keys and tail_select for a KeyLayout, in shapes that keep the
    graphs few: keys padded to Sp, a whole number of KEY_CHUNK chunks; the tail at least one chunk wide (a step
    whose rows all see a prefix, which KeyLayout computes without a tail, gets its last chunk as the tail) and of
    at least two chunks (an empty one added), so that no size is ever 0 or 1, which inductor would specialise on."""
    C = KEY_CHUNK
    Sp = max(round_up(layout.keys, C), 2 * C)  # PaddedKVCache keeps two chunks at least
    key_bias = F.pad(layout.key_bias, (0, Sp - layout.keys), value=-torch.inf)
    if layout.tail_select is None:
        L0 = Sp - C
        tail_select = torch.isfinite(key_bias[:, L0:]).to(key_bias.dtype)[None]
    else:
        L0 = layout.n_shared * C
        tail_select = F.pad(layout.tail_select, (0, Sp - layout.keys))
    if tail_select.shape[0] < 2:
        tail_select = F.pad(tail_select, (0, 0, 0, 0, 0, 2 - tail_select.shape[0]))
    slots = torch.arange(Sp, device=key_bias.device)
    # The tail's slots made afresh, not cut from `slots`: a graph traced from a view at storage offset L0 >= 2 would
    # refuse a step whose L0 is 0 or 1 (a size or offset of 0 or 1 is specialised).
    return key_bias, (slots < L0).to(key_bias.dtype), torch.arange(L0, Sp, device=key_bias.device), tail_select


def compile_steps(model: Transformer, graphs: Path | None = None) -> Transformer:
    """Run the model's decoding steps compiled (CompiledSteps). Its attention kernel becomes the exact one (the
    layout chunked_attention computes, and the padded cache it reads), installed first when it is not; its row-tiled
    linear layers (device.make_exact) get the row count at which F.linear, the kernel a graph calls, gives every row
    the same bits (invariance.find_tiling on the unpacked kernel). device.check_invariance then tells whether the
    compiled steps are exact; its w7a8 layers' matmul in a graph gets its C++ body where one can be built
    (integer_linear.load_native_matmul; else a line says why and the Python body stays). graphs: a folder where the
    graphs are kept for later processes (SavedGraphs), or None (traced in this process). CPU only: on CUDA no
    compiled step has been built or tested. Returns the model."""
    if model.device.type != "cpu":
        raise ValueError(f"compiled steps are built and tested for the CPU only, not {model.device.type}; "
                         f"run without compiling there")
    if dist.is_available() and dist.is_initialized():
        raise ValueError("a compiled step runs a model on one process, not in a process group (a sharded model)")
    if model.attention_kernel.cache_type is not PaddedKVCache:
        apply_exact_attention(model)
    rows: dict[tuple, int] = {}
    for module in model.modules():
        if isinstance(module, RowTiledLinear):
            key = (tuple(module.weight.shape), module.weight.dtype)
            if key not in rows:
                tiling = find_tiling(module.weight, packed=False)
                rows[key] = tiling.rows if tiling is not None and not tiling.split else 1  # the check says
            module.graph_rows = rows[key]
    missing = attention_op.load()
    if missing:
        print(f"minilade: compiled steps attend through torch operations ({missing})", file=sys.stderr)
    if any(isinstance(module, W7A8Linear) for module in model.modules()):
        pack_layers(model)  # a graph's w7a8 matmul finds a layer's packing by its scales: packed before any runs
        missing = load_native_matmul()
        if missing:
            print(f"minilade: w7a8 matmuls in compiled steps call their Python body ({missing})", file=sys.stderr)
    model.step_runner = CompiledSteps(model, graphs)
    return model
