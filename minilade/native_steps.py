"""Every forward of a w7a8 model as native layers: one C++ operator call a pass, every operation row by row.

A compiled step (compiled.py) runs some 20 generated kernels and external calls a layer from inductor's Python
wrapper, each a parallel region of its own, and on a one-row step of the demo model that host work costs about as
much again as the weight matmuls. `NativeSteps` runs the layers of a forward as one call of a C++ operator
(csrc/native_layer.cpp) that holds the model's layer weights (`registered`): the norms, the rounding of activations
to 8-bit codes, rotary, the cache writes, attention and SwiGLU are loops over each row's own numbers, and the weight
matmuls are integer dot products over a copy of each weight's codes laid out for them (csrc/native_matmul.h: the
bits of fbgemm's w7a8 call, the one W7A8Linear makes, and whole passes x0.95-1.3 as fast as through it; LLM.load
then lets go of the layers' own codes, `take_over`, and nothing packs them for fbgemm). The operator takes the rows
of several calls, each over its own cache (`layers_pass`): the server runs every call of a pass, its requests'
steps and prompt parts, as one pass through it (serve/native_pass.py). Its caches keep keys and values in float16
(`NativeSteps.cache_dtype`): a pass over several requests' caches reads about as many bytes of them as of weights.

Exactness, by construction: a row's operations are the same code whatever the other rows are, with sums in an order
the code fixes, not the row count; its attention visits the slots it sees in ascending order, which is the order
of their positions, so a token gets the same keys, values and logits as a row of a wide step or as a step of its
own; the weight matmuls give each row the same bits at every row count. device.check_invariance verifies the whole
step before it is used (compile_policy.choose_steps). The rounding is the operator's own, not the eager step's: a
model runs every forward natively or none, the prefill included (unlike compiled steps, whose prefill is eager), so
a prompt's rows are what decoding steps would give them: a prompt read in parts, or from rows kept from an earlier
answer (the server's prefix cache), gets the bits of the whole prompt read at once.
"""

from __future__ import annotations

import hashlib
import itertools
import weakref
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from . import native
from .integer_linear import W7A8Linear
from .kv_cache import KVCache
from .model import Transformer, check_mask
from .sampling import with_choices

SOURCE = Path(__file__).parent / "csrc" / "native_layer.cpp"  # and the headers it includes, HEADERS
HEADERS = sorted((Path(__file__).parent / "csrc").glob("native_*.h"))


PROMPT_PART = 256  # rows of a long causal forward (a prompt) a pass at most: its visible slots grow as rows x keys


class NativeCall(NamedTuple):
    """One call's part of a native pass: tokens (T,), their rotary positions (T,), its cache and its mask (T, T) or
    None (causal), as Transformer.forward takes them; past: the cache rows the call's rows follow (None:
    cache.length), its keys and values going to slots [past, past + T)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cache: KVCache
    mask: torch.Tensor | None
    past: int | None = None

    @property
    def start(self) -> int:
        """The slot of the call's first row."""
        return self.cache.length if self.past is None else self.past


def native_missing(model: Transformer) -> str | None:
    """Why this model's steps cannot run as native layers, or None: a model they do not serve (unserved), or the
    operator not built here (load: once a machine, in seconds)."""
    return unserved(model) or load()


def unserved(model: Transformer) -> str | None:
    """Why native steps do not serve this model, or None: they need the CPU, float32 activations, every layer's
    weight matmuls in w7a8 without biases, and an even head width up to 512."""
    if model.device.type != "cpu":
        return f"native steps run on the CPU, not {model.device.type}"
    if model.dtype != torch.float32:
        return f"native steps compute in float32, not {str(model.dtype).removeprefix('torch.')}"
    head_dim = model.config.head_dim
    if head_dim % 2 or head_dim > 512:
        return f"native steps need an even head width up to 512, not {head_dim}"
    for block in model.layers:
        linears = (block.attention.wqkv, block.attention.wo, block.feed_forward.w_gate_up, block.feed_forward.w_down)
        if not all(isinstance(m, W7A8Linear) and m.bias is None for m in linears):
            return "native steps need every layer's weights in w7a8, without biases"
    return None


def load() -> str | None:
    """Build (once a machine: the source is compiled for its processor) and load the operator; None when it is
    loaded, else why not, in one line. -ffp-contract=off: no multiply-add is fused, so that a loop's vectorised body
    and its scalar remainder round alike. -fno-trapping-math: no floating-point exception traps (none is enabled),
    which lets the compiler vectorise loops with selects in them where the processor has no masked operations (AVX2:
    attention's exponentials), computing the same IEEE operations, so the same bits (checked for every float input
    of exp2_approx, and whole passes against a build without it)."""
    if hasattr(torch.ops.minilade_native_layer, "layers"):
        return None
    return native.build("native_layer", SOURCE,
                        ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"],
                        what="native layer", for_processor=True)


class NativeSteps:
    """A model's step_runner (Transformer.forward hands it every forward, the prefill included): the layers as one
    native pass (layers_pass), then the final norm and output head over the rows whose logits it wants (`logits`);
    the embedding as the eager step looks it up."""

    # In the keys under which step costs and exactness verdicts are kept: they hold for these sources only.
    sources = f"native {hashlib.sha256(b''.join(f.read_bytes() for f in [SOURCE, *HEADERS])).hexdigest()[:12]}"

    @property
    def name(self) -> str:
        """The steps' name in kept keys: the sources, and whether the matmuls run on matrix tiles (the same bits,
        another step cost)."""
        return f"{self.sources} on matrix tiles" if uses_matrix_tiles() else self.sources

    # The prefill too (Transformer.forward): a prompt's rows then get the bits a decoding step would give them, so
    # that rows kept from an answer serve a later prompt exactly, and a prompt read in parts gets its whole bits.
    runs_prefill = True
    # The caches it reads: plain ones, keys and values in 16 bits (the operator rounds each once, as it writes it,
    # whichever step writes it): the part of a pass's reads that grows with the context, halved.
    cache_type, cache_dtype = KVCache, torch.float16

    def __call__(self, model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache,
                 mask: torch.Tensor | None, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """As Transformer.forward: tokens (1, T), input_pos (1, T); returns logits (1, R, V). A long causal forward
        (a prompt) runs in passes of PROMPT_PART rows, each after the ones before: the same bits, since a row's
        result does not depend on the rows of its pass."""
        if tokens.shape[0] != 1:
            raise ValueError(f"native steps run one sequence a cache, not {tokens.shape[0]}")
        positions, part = input_pos.reshape(-1), PROMPT_PART
        if mask is not None:  # a step whose rows see each other as its mask says: one pass
            x = layers_pass(model, [NativeCall(tokens[0], positions, cache, mask)])
        else:  # causal: in parts, each after the ones before
            parts = [layers_pass(model, [NativeCall(tokens[0, a:a + part], positions[a:a + part], cache, None,
                                                    cache.length + a)])
                     for a in range(0, tokens.shape[1], part)]
            x = parts[0] if len(parts) == 1 else torch.cat(parts)
        return logits(model, x if logits_rows is None else x[logits_rows])


def logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The final norm and output head over rows of the last layer's output, x (R, dim): logits (1, R, V). By the
    operator where it holds the model's head (a w7a8 head without bias: `native_head`), which also makes each row's
    greedy choice, handed over on the logits (sampling.with_choices); else as the eager step."""
    if native_head(model):
        logits, choices = torch.ops.minilade_native_layer.head(registered(model), x)
        return with_choices(logits[None], choices[None])
    return model.output(model.norm(x[None]))


def native_head(model: Transformer) -> bool:
    """Whether the operator computes the model's final norm and output head (register_layers): where the head is
    w7a8 without bias, as the layers' weights are."""
    return isinstance(model.output, W7A8Linear) and model.output.bias is None


def layers_pass(model: Transformer, calls: list[NativeCall], registration: int | None = None) -> torch.Tensor:
    """Every layer over the rows of several calls, each over its own cache: the last layer's output (sum T, dim),
    the calls' rows in order; each call's keys and values written into its cache at [length, length + T).
    registration: the key of the model's layers with the operator (None: `registered(model)`).

    What the operator is handed besides the weights it holds (the rows' embeddings, rotary rows, visible slots) is
    laid out on the host in numpy where it can be: the layout is a few dozen small operations a pass, each a few
    times cheaper in numpy than through torch's dispatcher, and all of it host time the operator waits for."""
    tokens = calls[0].tokens if len(calls) == 1 else torch.cat([call.tokens for call in calls])
    positions = calls[0].positions if len(calls) == 1 else torch.cat([call.positions for call in calls])
    cos, sin = rotary_rows(model, positions)
    slots, offsets = pass_slots(model, calls)
    keys, values = [call.cache.k for call in calls], [call.cache.v for call in calls]
    rows, past = [call.tokens.shape[0] for call in calls], [call.start for call in calls]
    x = model.tok_embeddings(tokens).to(model.dtype).contiguous()
    registration = registered(model) if registration is None else registration
    return torch.ops.minilade_native_layer.layers(registration, x, cos, sin, keys, values, rows, past, slots, offsets)


def rotary_rows(model: Transformer, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, D) at positions (T,): the rows model.rotary gives, gathered from its tables on the host; a
    position outside them is model.rotary's ValueError."""
    at = positions.numpy()
    if at.size and (at.min() < 0 or at.max() >= model.rope_cos.shape[0]):
        model.rotary(positions)  # raises
    return torch.from_numpy(model.rope_cos.numpy()[at]), torch.from_numpy(model.rope_sin.numpy()[at])


def pass_slots(model: Transformer, calls: list[NativeCall]) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots each row of a pass sees, ascending, every row's in one tensor (int32), and where each row's
    begin (offsets (rows + 1,) int64: row r's are slots[offsets[r]:offsets[r + 1]]). A row sees the committed slots
    [0, start), then the call's rows its mask allows, each at slot start + its row (causal: rows up to its own):
    the rows of model.py's step_visibility, laid out in numpy; under a sliding window, what visible_slots says."""
    slots, counts = [], []
    for call in calls:
        T, start = call.tokens.shape[0], call.start
        if model.config.sliding_window:
            seen, count = (t.numpy() for t in visible_slots(model, call))
        elif call.mask is None:
            count = np.arange(start + 1, start + T + 1)
            seen = ranges(count)
        else:
            check_mask(call.mask, T)
            visible = np.ones((T, start + T), dtype=bool)
            visible[:, start:] = call.mask.numpy()
            seen, count = np.nonzero(visible)[1], visible.sum(1)
        slots.append(seen)
        counts.append(count)
    counts = np.concatenate(counts)
    offsets = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return torch.from_numpy(np.concatenate(slots).astype(np.int32, copy=False)), torch.from_numpy(offsets)


def ranges(ends: np.ndarray) -> np.ndarray:
    """[0, ends[0]) then [0, ends[1]) ... in one int32 array."""
    if ends.size == 1:
        return np.arange(ends[0], dtype=np.int32)
    starts = np.repeat(np.cumsum(ends) - ends, ends)  # where each range begins in the result
    return (np.arange(starts.size) - starts).astype(np.int32)


_KEYS: weakref.WeakKeyDictionary[Transformer, int] = weakref.WeakKeyDictionary()
_NEXT_KEY = itertools.count()


def registered(model: Transformer) -> int:
    """The key under which the operator holds the model's layer weights (register_layers), registered at the model's
    first native pass and forgotten when the model goes: a pass then hands the operator none of them (gathering
    them through the modules' attributes, and torch checking a call's packed weights for fake ones, took some 25 us
    a layer). A model's layers do not change once its steps run natively."""
    if model not in _KEYS:
        _KEYS[model] = register_layers(model)
    return _KEYS[model]


def register_layers(model: Transformer, integer_matmul: bool = True) -> int:
    """Hand the operator the model's layer weights (its norms and four w7a8 weights a layer, each's codes laid out for
    the operator's integer matmul, or packed for fbgemm's call without: every matmul through that call, to compare
    the two) under a new key, forgotten when the model goes; returns the key."""
    key, ops, config = next(_NEXT_KEY), torch.ops.minilade_native_layer, model.config
    for block in model.layers:
        attention, ffn = block.attention, block.feed_forward
        codes, scales = zip(*(linear.weight_codes() for linear in (attention.wqkv, attention.wo, ffn.w_gate_up,
                                                                    ffn.w_down)))
        ops.add_layer(key, block.attention_norm.weight.detach().contiguous(),
                      block.ffn_norm.weight.detach().contiguous(), block.attention_norm.eps, codes, scales,
                      config.n_heads, config.n_kv_heads, integer_matmul)
    if native_head(model):
        ops.add_head(key, model.norm.weight.detach().contiguous(), model.norm.eps, *model.output.weight_codes(),
                     integer_matmul)
    weakref.finalize(model, ops.forget_model, key).atexit = False
    return key


def has_matrix_tiles() -> bool:
    """Whether the operator can compute its matmuls with matrix tiles (AMX: the processor has them, the build
    compiled them and the kernel lets this process use them); load() first."""
    return torch.ops.minilade_native_layer.has_matrix_tiles()


def uses_matrix_tiles() -> bool:
    """Whether native matmuls run on matrix tiles now (use_matrix_tiles); False where the operator is not loaded."""
    return hasattr(torch.ops.minilade_native_layer, "uses_matrix_tiles") and \
        torch.ops.minilade_native_layer.uses_matrix_tiles()


def use_matrix_tiles(on: bool) -> bool:
    """Compute every native matmul of this process with matrix tiles (where has_matrix_tiles), or with the vector
    loop: the same integer sums, so the same bits; only the speed differs (compile_policy.verdict measures which is
    faster here). Returns whether tiles are now on."""
    on = on and has_matrix_tiles()
    torch.ops.minilade_native_layer.use_matrix_tiles(on)
    return on


def take_over(model: Transformer) -> None:
    """Hand the model's layers to the operator for good (`registered`: it keeps their codes laid out for its matmul)
    and let go of the layers' own codes, which native passes do not read: one byte a weight less (106 MB for the demo
    model). The layers' W7A8Linear modules then run only inside native steps (called by themselves, they say so).
    LLM.load does this once it chose native steps."""
    registered(model)
    for block in model.layers:
        for linear in (block.attention.wqkv, block.attention.wo, block.feed_forward.w_gate_up,
                       block.feed_forward.w_down):
            linear.hand_over()
    if native_head(model):
        model.output.hand_over()


def visible_slots(model: Transformer, call: NativeCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots each row of a call sees under the model's sliding window, ascending (int32, all rows' in one
    tensor), and how many a row (T,): the committed rows and the step rows its mask allows, cut by the window
    (Transformer.step_masks)."""
    T = call.tokens.shape[0]
    visible, _ = model.step_masks(call.mask, call.start, T, call.positions)  # (T, past + T)
    if visible is None:  # a causal step over an empty cache, nothing outside the window
        visible = torch.ones(T, T, dtype=torch.bool).tril_()
    return visible.nonzero()[:, 1].to(torch.int32), visible.sum(1)
