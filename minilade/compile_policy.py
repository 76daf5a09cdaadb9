"""Where and when a model's steps are compiled: the choice LLM.load(compile=...) makes, and a first run's compile.

`choose_steps` installs compiled steps (compiled.py) where they pass the exactness check and, unless forced,
measure faster than eager ones, and keeps what it found per machine; on a first run `compile_kinds_at_once` traces
the two kinds of graph (one-row and wider steps) at the same time, the wider in a forked process, so that the first
compile takes about as long as one graph.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist

from .compiled import CompiledSteps, compile_steps
from .decoding.step_costs import cost_key, measure_step_costs
from .device import check_invariance
from .invariance import RowTiledLinear
from .masks import interleaved_step
from .memo import read_table, write_entry
from .model import Transformer
from .saved_graphs import GRAPHS_FOLDER


def compiler_missing() -> str | None:
    """Why steps cannot be compiled here (no C++ compiler for inductor's CPU code), or None."""
    if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on PATH"
    return None


def choose_steps(model: Transformer, check_file: str | Path | None = None, *, force: bool = False) -> str:
    """Compile the model's steps (compile_steps) where that is exact and, unless `force`, measured faster: the
    compiled steps must pass device.check_invariance, and a one-row plus an 8-row step after 128 tokens must take
    less time than eagerly. Compiling is not tried, unless forced, where a weight matmul would need padding rows
    in the graph (RowTiledLinear.graph_rows > 1: float32 here, measured slower than its eager prepacked kernel).
    What was found is kept in check_file (JSON, per model, machine and kernels), the graphs in a folder beside it
    (GRAPHS_FOLDER, compiled.SavedSteps), so a later process neither measures nor traces again. The model is left
    eager when compiled steps lose or fail; the return value says which, in a few words, for the user."""
    missing = compiler_missing()
    if missing:
        return f"eager steps ({missing})"
    if model.device.type != "cpu" or (dist.is_available() and dist.is_initialized()):
        return "eager steps"
    compile_steps(model, Path(check_file).parent / GRAPHS_FOLDER if check_file is not None else None)
    if not force and any(m.graph_rows > 1 for m in model.modules() if isinstance(m, RowTiledLinear)):
        model.step_runner = None
        return "eager steps (compiled ones would pad each weight matmul to more rows)"
    key = cost_key(model)
    known = (read_table(check_file) or {}).get(key) if check_file is not None else None
    if known is None:
        print("minilade: compiling the model's steps, once for this machine (under a minute on 2 cores; "
              "--compile off or compile=False skips it)", file=sys.stderr, flush=True)
        compile_kinds_at_once(model)
        runner, exact = model.step_runner, check_invariance(model)
        seconds = {}
        for name, step_runner in (("eager", None), ("compiled", runner)):
            model.step_runner = step_runner
            seconds[name] = sum(measure_step_costs(model, (1, 8), context=128, repeats=2).values())
        model.step_runner = runner
        known = {"exact": exact, "eager_s": seconds["eager"], "compiled_s": seconds["compiled"]}
        if check_file is not None:
            write_entry(check_file, key, known)
    if not known["exact"]:
        model.step_runner = None
        return "eager steps (compiled ones failed the exactness check here)"
    if not force and known["compiled_s"] >= known["eager_s"]:
        model.step_runner = None
        return f"eager steps (measured faster than compiled: {known['eager_s'] * 1e3:.0f} against " \
               f"{known['compiled_s'] * 1e3:.0f} ms for a 1- and an 8-row step)"
    return f"compiled steps ({known['compiled_s'] * 1e3:.0f} ms for a 1- and an 8-row step, eager " \
           f"{known['eager_s'] * 1e3:.0f})"


def compile_kinds_at_once(model: Transformer) -> None:
    """Compile the saved graphs of one-row and of wider steps (compiled.SavedSteps) at the same time, where neither is
    saved yet: the wider one in a forked process, the one-row one here. Tracing and lowering a graph is Python, one
    core's work (some 20-40 s a graph for the demo model on 2 cores), so the two take about as long as one.

    The second process only traces and saves: its inputs are made here before the fork, over a cache whose
    contents do not matter (a trace sees shapes), and it runs no kernel, so it needs none of the OpenMP threads a
    fork does not copy (and keeps torch's thread count, which a graph's guards check). If it fails, its graph is
    compiled here at the first wider step, as without this. Nothing is done where there is no fork (not Linux) or
    one core, nor for a model whose steps are not saved graphs."""
    runner = model.step_runner
    if not (isinstance(runner, CompiledSteps) and runner.graphs is not None and sys.platform == "linux"
            and (os.cpu_count() or 1) > 1):
        return
    graphs, device = runner.layers_runner(model), model.device
    with torch.inference_mode(False):  # a cache as generation makes one
        cache = model.new_cache(64)
    cache.commit(5)  # as if after a prompt of 5 tokens
    with torch.inference_mode():  # the mode every step runs in (decoding, the check, the step-cost timer)
        kinds = {rows: graphs.kind(rows) for rows in (1, 16)}
        if any(graphs.path(kind)[1].exists() or kind in graphs.graphs for kind in kinds.values()):
            return
        positions, mask = interleaved_step(5, 16, lanes=4)
        inputs = {1: runner.layers_inputs(model, torch.zeros(1, 1, dtype=torch.long, device=device),
                                          torch.tensor([[5]], device=device), cache, None),
                  16: runner.layers_inputs(model, torch.zeros(1, 16, dtype=torch.long, device=device),
                                           positions[None].to(device), cache, mask.to(device))}
        print("minilade: compiling the graphs of one-row and of wider steps (the wider in a second process)...",
              end="", file=sys.stderr, flush=True)
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the second process: trace, save, and go without running any exit handler
            status = 1
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the parent speaks for both
                inductor_config.compile_threads = 1  # C++ compiled here, not by workers the parent may have started
                graphs.compile(kinds[16], inputs[16])
                status = 0
            finally:
                os._exit(status)
        try:
            graphs.graphs[kinds[1]] = graphs.compile(kinds[1], inputs[1])
        finally:
            failed = wait_or_kill(pid, bound_s=2 * (time.perf_counter() - start) + 30)
    print(f" {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if failed:
        print(f"minilade: the second process did not save its graph ({failed}); it is compiled at the first wider "
              f"step", file=sys.stderr, flush=True)


def wait_or_kill(pid: int, bound_s: float) -> str | None:
    """Wait for a child process for at most bound_s seconds: None if it exited 0, else how it ended, killed here
    past the bound (a fork of a process with other threads can deadlock in the child, on a lock one of them held)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return None if code == 0 else f"exit status {code}"
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return f"killed after {bound_s:.0f} s"
