"""How a model's decoding steps run: the choice LLM.load(compile=...) makes, and a first run's compile.

`choose_steps` installs native steps (native_steps.py) where they serve the model (their matmuls on matrix tiles
where the processor has them and they measure faster), else compiled steps (compiled.py), where they pass the
exactness check and, unless forced, measure faster than eager ones, and keeps what it found per machine; on a
first run `compile_kinds_at_once` traces the two kinds of graph (one-row and wider steps) at the same time, the
wider in a forked process, so that the first compile takes about as long as one graph.
"""

from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .compiled import CompiledSteps, compile_steps
from .decoding.step_costs import cost_key, measure_step_costs
from .device import check_invariance
from .invariance import RowTiledLinear
from .masks import interleaved_step
from .memo import measuring, read_table, write_entry
from .model import Transformer
from .native_steps import NativeSteps, has_matrix_tiles, unserved, use_matrix_tiles
from .native_steps import load as load_native
from .saved_graphs import GRAPHS_FOLDER, compile_at_once


def compiler_missing() -> str | None:
    """Why steps cannot be compiled here (no C++ compiler for inductor's CPU code), or None."""
    if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on PATH"
    return None


def choose_steps(model: Transformer, check_file: str | Path | None = None, *, force: bool = False) -> str:
    """Run the model's decoding steps as native layers (native_steps.py) or compiled graphs (compile_steps), where
    that is exact and, unless `force`, measured faster than eager steps; `force` asks for compiled graphs.

    Native steps come first where they serve the model (w7a8 layers in float32): built in seconds, they need no
    graphs and ran faster than compiled ones wherever measured (docs/benchmarks.md). Else the steps are compiled,
    except, unless forced, where a weight matmul would need padding rows in the graph (RowTiledLinear.graph_rows > 1:
    float32 here, measured slower than its eager prepacked kernel). Either must pass device.check_invariance, and a
    one-row plus an 8-row step after 128 tokens must take less time than eagerly. What was found is kept in
    check_file (JSON, per model, machine and kernels: step_costs.cost_key, which names the runner), compiled graphs
    in a folder beside it (GRAPHS_FOLDER, compiled.SavedSteps), so a later process neither measures nor traces
    again. The model is left eager when both lose or fail; the return value says which, in a few words, for the
    user."""
    missing = compiler_missing()
    if missing:
        return f"eager steps ({missing})"
    if model.device.type != "cpu" or (dist.is_available() and dist.is_initialized()):
        return "eager steps"
    if not force and unserved(model) is None:
        unbuilt = load_native()
        if unbuilt is not None:
            print(f"minilade: native steps unavailable ({unbuilt}); trying compiled steps", file=sys.stderr)
        else:
            model.step_runner = NativeSteps()
            use_matrix_tiles(False)  # the verdict is kept under the vector loop's name, tiles' choice in it
            known = verdict(model, check_file, "native")
            if known["exact"] and known["native_s"] < known["eager_s"]:
                tiles = use_matrix_tiles(known.get("matrix_tiles", False))
                return f"native steps{' on matrix tiles' if tiles else ''} ({known['native_s'] * 1e3:.0f} ms for " \
                       f"a 1- and an 8-row step, eager {known['eager_s'] * 1e3:.0f})"
            model.step_runner = None
    compile_steps(model, Path(check_file).parent / GRAPHS_FOLDER if check_file is not None else None)
    if not force and any(m.graph_rows > 1 for m in model.modules() if isinstance(m, RowTiledLinear)):
        model.step_runner = None
        return "eager steps (compiled ones would pad each weight matmul to more rows)"
    if kept_verdict(model, check_file) is None:
        print("minilade: compiling the model's steps, once for this machine (under a minute on 2 cores; "
              "--compile off or compile=False skips it)", file=sys.stderr, flush=True)
        compile_kinds_at_once(model)
    known = verdict(model, check_file, "compiled")
    if not known["exact"]:
        model.step_runner = None
        return "eager steps (compiled ones failed the exactness check here)"
    if not force and known["compiled_s"] >= known["eager_s"]:
        model.step_runner = None
        return f"eager steps (measured faster than compiled: {known['eager_s'] * 1e3:.0f} against " \
               f"{known['compiled_s'] * 1e3:.0f} ms for a 1- and an 8-row step)"
    return f"compiled steps ({known['compiled_s'] * 1e3:.0f} ms for a 1- and an 8-row step, eager " \
           f"{known['eager_s'] * 1e3:.0f})"


def kept_verdict(model: Transformer, check_file: str | Path | None) -> dict | None:
    """What verdict() found for the model's steps as they run now, kept in check_file, or None."""
    return (read_table(check_file) or {}).get(cost_key(model)) if check_file is not None else None


def verdict(model: Transformer, check_file: str | Path | None, name: str) -> dict:
    """Whether the model's step_runner (named `name` in the verdict) passes device.check_invariance, and the seconds
    of a one-row plus an 8-row step after 128 tokens through it and eagerly: {"exact", "eager_s", name + "_s"}, and
    for native steps where the processor has matrix tiles, whether to use them (matrix_tiles_verdict); kept in
    check_file (kept_verdict) or measured now and kept there. Leaves the runner installed."""
    known = kept_verdict(model, check_file)
    if known is None:
        with measuring(f"{name} steps against eager ones", check_file):
            runner, exact = model.step_runner, check_invariance(model)
            seconds = {}
            for label, step_runner in (("eager", None), (name, runner)):
                model.step_runner = step_runner
                seconds[label] = sum(measure_step_costs(model, (1, 8), context=128, repeats=2).values())
            model.step_runner = runner
            known = {"exact": exact, "eager_s": seconds["eager"], f"{name}_s": seconds[name]}
            if name == "native" and has_matrix_tiles():
                known.update(matrix_tiles_verdict(model))
        if check_file is not None:
            write_entry(check_file, cost_key(model), known)
    return known


TILE_ROUNDS = 3  # alternate measurements of native steps with and without matrix tiles


def matrix_tiles_verdict(model: Transformer) -> dict:
    """Whether the model's native steps run faster with their matmuls on matrix tiles (native_steps.use_matrix_tiles:
    the same integer sums, a step's bits unchanged, which device.check_invariance checks here too): a one-row plus
    an 8-row step timed TILE_ROUNDS times each way, alternately (on an AMX Xeon they differ by a few percent, within
    one measurement's noise on a shared machine). Leaves tiles off; returns {"matrix_tiles", "native_s"}."""
    exact = check_invariance(model)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(TILE_ROUNDS):
        for on in (False, True):
            use_matrix_tiles(on)
            seconds[on].append(sum(measure_step_costs(model, (1, 8), context=128, repeats=2).values()))
    use_matrix_tiles(False)
    vector_s, tiles_s = (statistics.median(seconds[on]) for on in (False, True))
    faster = exact and tiles_s < vector_s
    return {"matrix_tiles": faster, "native_s": tiles_s if faster else vector_s}


def compile_kinds_at_once(model: Transformer) -> None:
    """Compile the saved graphs of one-row and of wider steps (compiled.SavedSteps) at the same time, where neither is
    saved yet (saved_graphs.compile_at_once: the wider in a forked process), so that a first run's compile takes
    about as long as one graph. The steps' inputs are made over a cache whose contents do not matter (a trace sees
    shapes). Nothing is done for a model whose steps are not saved graphs."""
    runner = model.step_runner
    if not (isinstance(runner, CompiledSteps) and runner.graphs is not None):
        return
    graphs, device = runner.layers_runner(model), model.device
    with torch.inference_mode(False):  # a cache as generation makes one
        cache = model.new_cache(64)
    cache.commit(5)  # as if after a prompt of 5 tokens
    with torch.inference_mode():  # the mode every step runs in (decoding, the check, the step-cost timer)
        kinds = {rows: graphs.kind(rows) for rows in (1, 16)}
        if any(graphs.kept(kind) for kind in kinds.values()):
            return
        positions, mask = interleaved_step(5, 16, lanes=4)
        inputs = {1: runner.layers_inputs(model, torch.zeros(1, 1, dtype=torch.long, device=device),
                                          torch.tensor([[5]], device=device), cache, None),
                  16: runner.layers_inputs(model, torch.zeros(1, 16, dtype=torch.long, device=device),
                                           positions[None].to(device), cache, mask.to(device))}
        compile_at_once([(graphs, kinds[rows], inputs[rows]) for rows in (1, 16)], "one-row and of wider steps")
