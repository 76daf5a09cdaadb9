"""Device and dtype policy, and making a loaded model exact (batch-invariant) on the machine it runs on.

Lookahead's output equals plain decoding's only if a token's logits do not depend on the shape of the step that
computed them. `make_exact` installs the attention kernel that is so by construction (minilade/invariance.py);
weight matmuls depend on the kernel the library picks, so it also measures, per weight shape, a row tiling under
which rows come out the same at every row count (`find_tiling`), for the plain kernel and for oneDNN's prepacked
one, keeps the faster, and then checks the whole model: a token's logits from a one-row step must equal its row
in a wide masked step, bitwise (`check_invariance`). What it found is kept per machine in a small JSON file, like
the step costs. On CUDA the same is done with cuBLAS's matmul (no prepacked kernel) and attention's tiles for a GPU
(invariance.attention_tiles).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .decoding.step_costs import compare_step_costs, cost_key, measure_step_costs
from .invariance import (
    RowTiledLinear,
    RowTiling,
    apply_exact_attention,
    find_tiling,
    linear_kernel,
    prepack,
    tiled_matmul,
)
from .masks import interleaved_step
from .memo import measuring, read_table, write_entry
from .model import Transformer
from .native_steps import NativeSteps, native_missing
from .quant import quantize_embedding, quantize_linears


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype to load in. "auto" (or None): on CUDA bfloat16 where supported, else float16; on the CPU float32,
    after which `choose_dtype` may measure that another dtype is faster and exact."""
    if dtype is None or dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)} or auto") from None


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN prepacking exists for float32 weights on the CPU in this torch build."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


# ---- choosing row tilings -------------------------------------------------------------------------------------


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every plain or already tiled linear layer."""
    return [(module, name, child) for module in model.modules() for name, child in module.named_children()
            if isinstance(child, (nn.Linear, RowTiledLinear))]


def shape_key(weight: torch.Tensor) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]}"


def probe_tilings(model: Transformer, packed: bool) -> dict[str, RowTiling] | None:
    """An invariant tiling for each weight shape of the model with one kernel, or None if a shape has none."""
    found: dict[str, RowTiling] = {}
    for _, _, layer in linear_layers(model):
        key = shape_key(layer.weight)
        if key not in found:
            tiling = find_tiling(layer.weight, packed)
            if tiling is None:
                return None
            found[key] = tiling
    return found


def linear_seconds(model: Transformer, tilings: dict[str, RowTiling], sizes=(1, 4, 16, 64), repeats: int = 5
                   ) -> float:
    """Sum over row counts of the median time of one block's linear layers and the output head, tiled."""
    layers = [layer for _, _, layer in linear_layers(model.layers[0])]
    layers += [model.output] if isinstance(model.output, (nn.Linear, RowTiledLinear)) else []  # not if quantized
    total = 0.0
    with torch.inference_mode():
        for M in sizes:
            runs = []
            for layer in layers:
                tiling = tilings[shape_key(layer.weight)]
                kernel = linear_kernel(layer.weight, layer.bias, prepack(layer.weight) if tiling.packed else None)
                x = torch.randn(M, layer.weight.shape[1], dtype=model.dtype)
                samples = []
                for rep in range(repeats + 1):
                    start = time.perf_counter()
                    tiled_matmul(x, kernel, tiling)
                    if rep:
                        samples.append(time.perf_counter() - start)
                runs.append(statistics.median(samples))
            total += sum(runs)
    return total


def choose_tilings(model: Transformer) -> list[dict[str, RowTiling]]:
    """Invariant tilings per kernel (plain, and prepacked where available), the faster first."""
    options = [probe_tilings(model, packed) for packed in (False, True)
               if not packed or packing_available(model.dtype, model.device)]
    options = [o for o in options if o is not None]
    return sorted(options, key=lambda o: linear_seconds(model, o)) if len(options) > 1 else options


def apply_tilings(model: Transformer, tilings: dict[str, RowTiling]) -> Transformer:
    """Replace every linear layer by a RowTiledLinear under its shape's tiling (tied weights stay tied)."""
    for parent, name, layer in linear_layers(model):
        linear = layer if isinstance(layer, nn.Linear) else _as_linear(layer)
        setattr(parent, name, RowTiledLinear(linear, tilings[shape_key(layer.weight)]))
    return model


def _as_linear(layer: RowTiledLinear) -> nn.Linear:
    linear = nn.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=layer.bias is not None,
                       device="meta")
    linear.weight, linear.bias = layer.weight, layer.bias
    return linear


# ---- the whole-model check -----------------------------------------------------------------------------------


def check_invariance(model: Transformer, contexts=(5, 70), width: int = 16, lanes: int = 4, seed: int = 0
                     ) -> bool:
    """A token's logits from one-row steps equal, bitwise, its rows in a wide interleaved step (lanes 0 and 1
    carry the same chain) and in a causal multi-row step, after prompts of each context length (those that leave
    room for the step in the model's context; the shortest context is clamped to fit)."""
    device, vocab = model.device, model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    n = -(-width // lanes) + 1  # chain length: lane 0's rows and one more
    room = model.config.max_seq_len - width
    contexts = [c for c in contexts if c <= room] or [max(1, min(min(contexts), room))]
    with torch.inference_mode():
        for past in contexts:
            prompt = torch.randint(vocab, (1, past), generator=gen).to(device)
            chain = torch.randint(vocab, (n,), generator=gen).to(device)
            one_row = _one_row_steps(model, prompt, chain)  # (n, V)
            positions, mask = interleaved_step(past, width, lanes)
            tokens = torch.randint(vocab, (width,), generator=gen).to(device)
            lane0, lane1 = torch.arange(0, width, lanes), torch.arange(1, width, lanes)
            tokens[lane0], tokens[lane1] = chain[:len(lane0)], chain[1:1 + len(lane1)]
            wide = _after(model, prompt, tokens[None], mask.to(device), positions)
            causal = _after(model, prompt, chain[None], None, torch.arange(past, past + n))
            same = (torch.equal(wide[lane0], one_row[:len(lane0)]) and torch.equal(causal, one_row)
                    and torch.equal(wide[lane1], one_row[1:1 + len(lane1)]))
            if not same:
                return False
    return True


def _prefilled(model: Transformer, prompt: torch.Tensor, room: int):
    with torch.inference_mode(False):  # a cache as generation makes one
        cache = model.new_cache(prompt.shape[1] + room)
    model(prompt, torch.arange(prompt.shape[1], device=model.device), cache)
    cache.commit(prompt.shape[1])
    return cache


def _after(model: Transformer, prompt: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None,
           positions: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) of one step of tokens (1, T) after prefilling `prompt` (1, P)."""
    cache = _prefilled(model, prompt, tokens.shape[1])
    return model(tokens, positions.to(model.device), cache, mask)[0]


def _one_row_steps(model: Transformer, prompt: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """Logits (n, V) of feeding chain (n,) one token per step after prefilling `prompt`."""
    cache, rows = _prefilled(model, prompt, chain.numel()), []
    for token in chain.tolist():
        position = torch.tensor([cache.length], device=model.device)
        rows.append(model(torch.tensor([[token]], device=model.device), position, cache)[0, 0])
        cache.commit(1)
    return torch.stack(rows)


# ---- policy: tilings, the check, the dtype ----------------------------------------------------------------------


@dataclass
class Invariance:
    """What make_exact found: the tiling per weight shape, and whether the model passed the check."""

    exact: bool
    tilings: dict[str, RowTiling]

    def as_json(self) -> dict:
        return {"exact": self.exact, "tilings": {k: [t.rows, t.split, t.packed] for k, t in self.tilings.items()}}

    @classmethod
    def from_json(cls, raw: dict) -> "Invariance":
        return cls(bool(raw["exact"]), {k: RowTiling(int(r), bool(s), bool(p)) for k, (r, s, p) in
                                        raw["tilings"].items()})


def make_exact(model: Transformer, check_file: str | Path | None = None, *, warn: bool = True) -> Invariance:
    """Make the model's steps batch-invariant: install the exact attention kernel (invariance.ExactAttention) and
    give the linear layers row tilings under which the model passes check_invariance (the faster kernel first);
    return what was found, kept in check_file (JSON, per model shape, dtype, machine) when given. If no tiling
    passes, the model keeps the fastest and, with `warn`, one line on stderr says it is not exact."""
    apply_exact_attention(model)
    key = cost_key(model)
    known = (read_table(check_file) or {}).get(key) if check_file is not None else None
    if known is not None:
        found = Invariance.from_json(known)
        apply_tilings(model, found.tilings)
    else:
        found = None
        with measuring(f"whether {str(model.dtype).removeprefix('torch.')} steps are batch-invariant", check_file):
            for tilings in choose_tilings(model):
                apply_tilings(model, tilings)
                found = Invariance(check_invariance(model), tilings)
                if found.exact:
                    break
        found = found or Invariance(False, {})
        if check_file is not None:
            write_entry(check_file, key, found.as_json())
    if not found.exact and warn:
        print(f"minilade: {model.dtype} on this {model.device.type} is not batch-invariant: lookahead output "
              f"may differ from plain decoding at near-ties", file=sys.stderr)
    return found


def choose_dtype(model: Transformer, check_file: str | Path | None = None,
                 candidates=(torch.bfloat16, torch.float32)) -> Transformer:
    """The fastest dtype in which the model is exact on this CPU, measured: a copy of the (float32) model in each
    candidate dtype is made exact and checked, then timed on a one-row and a 32-row step; the winner is
    returned (the float32 model itself when it wins). Kept in check_file with the invariance verdicts, the choice
    too ("<key>|dtype"), so that a later load converts to and prepares the winner alone."""
    chosen_key = cost_key(model) + "|dtype"
    chosen = (read_table(check_file) or {}).get(chosen_key) if check_file is not None else None
    kept = [dtype for dtype in candidates if str(dtype) == chosen]
    if kept:
        candidate = model if kept[0] == model.dtype else _converted(model, kept[0])
        if make_exact(candidate, check_file, warn=False).exact:
            return candidate
    with measuring(f"the fastest exact dtype of {', '.join(str(d).removeprefix('torch.') for d in candidates)}",
                   check_file):
        best = _fastest_exact(model, check_file, candidates)
    if best is None:
        make_exact(model, check_file)  # says once that it is not exact
        return model
    if check_file is not None:
        write_entry(check_file, chosen_key, str(best.dtype))
    return best


def choose_quantization(model: Transformer, blocks: dict, modes: tuple[str, ...],
                        check_file: str | Path | None = None, *, native: bool = False) -> tuple[Transformer, str]:
    """The model with its linear layers quantized in whichever of `modes` (e.g. int4 and w7a8, quant.py) steps
    fastest on this CPU while passing the exactness check, measured: the model quantized each way (taking
    `blocks`, a file's codes by module name, as quantize_linears takes them; the embedding in int8 groups), made
    exact, then timed on a one-row and an 8-row step after 128 tokens (the widths auto feeds most), the modes in
    turn in each of 5 rounds, medians. native: time a mode through native steps where they serve it and pass the
    check (native_steps.py: how its steps will run), else eagerly. The choice is kept in check_file
    ("<key>|quantize"), so that a later load quantizes one way only. Returns the model, its steps eager, and a few
    words on the choice."""
    def quantized(mode: str, source: Transformer) -> Transformer:
        quantize_linears(source, mode, 32, weights=blocks)
        return quantize_embedding(source, blocks.get("tok_embeddings"))

    chosen_key = cost_key(model) + f"|quantize{'|native' if native else ''}"
    chosen = (read_table(check_file) or {}).get(chosen_key) if check_file is not None else None
    if chosen in modes:  # only an exact mode is kept; make_exact says so should its verdict have changed
        candidate = quantized(chosen, model)
        make_exact(candidate, check_file)
        return candidate, f"{chosen} measured fastest of {'/'.join(modes)} here"
    candidates, exact = {}, {}
    with measuring(f"the fastest exact quantization of {'/'.join(modes)}", check_file):
        for i, mode in enumerate(modes):
            candidates[mode] = candidate = quantized(mode, model if i == len(modes) - 1 else copy.deepcopy(model))
            if make_exact(candidate, check_file, warn=False).exact:
                exact[mode] = candidate
                if native and native_missing(candidate) is None:
                    candidate.step_runner = NativeSteps()
                    candidate.step_runner = candidate.step_runner if check_invariance(candidate) else None
        timed = compare_step_costs(exact, (1, 8), context=128, repeats=5)  # interleaved: one spell, all modes
    seconds = {mode: sum(by_size.values()) for mode, by_size in timed.items()}
    how = {mode: " (native steps)" if candidate.step_runner is not None else "" for mode, candidate in exact.items()}
    for candidate in exact.values():
        candidate.step_runner = None
    if not seconds:  # none is exact: the first, and make_exact says so
        make_exact(candidates[modes[0]], check_file)
        return candidates[modes[0]], modes[0]
    best = min(seconds, key=seconds.__getitem__)
    if check_file is not None:
        write_entry(check_file, chosen_key, best)
    timing = " against ".join(f"{mode}{how[mode]} {1e3 * s:.0f} ms" for mode, s in seconds.items())
    return candidates[best], f"{best} measured fastest of {'/'.join(modes)} here (a 1- and an 8-row step: {timing})"


def _fastest_exact(model: Transformer, check_file: str | Path | None, candidates) -> Transformer | None:
    """The model in the fastest candidate dtype that passes the check (made exact), or None if none does."""
    best, best_cost = None, float("inf")
    for dtype in candidates:
        candidate = model if dtype == model.dtype else _converted(model, dtype)
        if not make_exact(candidate, check_file, warn=False).exact:
            continue
        cost = _step_seconds(candidate, check_file)
        if cost < best_cost:
            best, best_cost = candidate, cost
    return best


def _converted(model: Transformer, dtype: torch.dtype) -> Transformer:
    """A copy of the model in another dtype (a deep copy, so a cut output head and tied weights stay as they are)."""
    converted = copy.deepcopy(model).to(dtype).eval()
    converted.setup_rope()
    return converted


def _step_seconds(model: Transformer, check_file: str | Path | None) -> float:
    """Seconds of a one-row plus a 32-row step after 128 tokens (kept in check_file under "<key>|steps")."""
    key = cost_key(model) + "|steps"
    known = (read_table(check_file) or {}).get(key) if check_file is not None else None
    if known is None:
        known = sum(measure_step_costs(model, (1, 32), context=128, repeats=2).values())
        if check_file is not None:
            write_entry(check_file, key, known)
    return float(known)
