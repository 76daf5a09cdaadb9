"""Compiled graphs kept between processes: traced once per machine, model and version of the code they come from.

torch.compile traces and lowers a step's graph in 20-40 s for the demo model on 2 cores, in every process.
`SavedGraphs` compiles a function ahead of time for each kind of call it serves and keeps the result in a folder
(GRAPHS_FOLDER, beside the kept tables), where a later process loads it in about a second. `tracing_config` is how
every graph is traced, and `traced_code_digest` names the version of the code they are traced from.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.fx.experimental._config as shape_config

from .errors import one_line

GRAPHS_FOLDER = "graphs"  # where saved graphs are kept: beside the kept tables (compile_policy.choose_steps)
# The modules whose code a layer's graph is traced from (a saved graph is kept per digest of them: SavedGraphs).
TRACED_FROM = ("compiled.py", "saved_graphs.py", "model.py", "invariance.py", "integer_linear.py", "quant.py",
               "kv_cache.py", "pool_step.py", "attention_op.py", "csrc/weighted_sums.cpp")


def tracing_config() -> contextlib.AbstractContextManager:
    """How a step's graph is traced: sizes equal by chance get symbols of their own (no duck shaping), or the guards
    would demand them equal ever after (and a layer's subgraph, traced with one size bound to another, fails when it
    is called with them apart); floats stay constants (aot_compile cannot restart its analysis when a float becomes a
    tensor); only the sizes marked dynamic (compiled.mark_dynamic_sizes) are, never those that differ between two
    models that ran through compiled.compiled_layers_step (dynamo's automatic dynamic shapes: a subgraph with weights
    of symbolic sizes fails to trace in torch 2.13). The graph's host code asserts no sizes, strides or alignments
    of its tensors (some 30 checks a layer, in Python): its guards check the inputs' sizes and strides before every
    call, and the rest are its own buffers and the outputs of our own operators; without the checks a one-row step
    of the demo model took 0.3-0.4 ms less (of 6.0-6.8 ms for its layers, the two graphs interleaved in one
    process), an 8-row step 0.4-0.5 ms less."""
    import torch._inductor.config as inductor_config  # here: importing the compiler takes over a second

    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(specialize_float=True, automatic_dynamic_shapes=False))
    stack.enter_context(shape_config.patch(use_duck_shape=False))
    stack.enter_context(inductor_config.patch(size_asserts=False, alignment_asserts=False))
    return stack


class SavedGraphs:
    """A traced function (compiled.layers_step, compiled.pass_layer_step) compiled ahead of time (torch.compile's
    aot_compile) and kept in a folder: a later process loads its graphs (some 5 s in all, most of it importing
    torch's compiler) instead of tracing them again (some 20-40 s each for the demo model's steps, on 2 cores).

    A graph serves the calls of one kind (for steps: one row or several, as inductor specialises a size of 1), in the
    autograd and inference modes it was traced in (its guards check them: modes_kind). Each kind is compiled from the
    arguments of one call and saved under a name made of the model's cost key (shapes, dtype, layers, machine, torch)
    and a digest of the code it is traced from: an edit of that code compiles anew (deleting the old graph). A file
    that does not load is compiled again."""

    def __init__(self, folder: Path, key: str, traced: Callable[..., torch.Tensor],
                 mark: Callable[[tuple], None]) -> None:
        """traced: the function compiled; mark: marks the sizes of its arguments that change from call to call."""
        self.folder, self.key, self.traced, self.mark, self.graphs = folder, key, traced, mark, {}

    def path(self, kind: str) -> tuple[str, Path]:
        """The name of a kind's graph (the same for every version of the traced code) and its file."""
        traced = self.traced.__name__.replace("_", "-")
        graph_name = f"{traced}-{hashlib.sha256(f'{self.key}|{kind}'.encode()).hexdigest()[:16]}"
        return graph_name, self.folder / f"{graph_name}-{traced_code_digest()[:16]}.pt2"

    def graph(self, kind: str, args: tuple) -> Callable[..., torch.Tensor]:
        """The graph of a kind, loaded or compiled from these arguments when first asked for."""
        if kind not in self.graphs:
            self.graphs[kind] = self._load_or_compile(kind, args)
        return self.graphs[kind]

    def kept(self, kind: str) -> bool:
        """Whether a kind's graph is here or saved in the folder."""
        return kind in self.graphs or self.path(kind)[1].exists()

    def load(self, kind: str) -> bool:
        """Load the saved graph of a kind, if there is one and it loads (else a line says why); whether it did."""
        path = self.path(kind)[1]
        if kind not in self.graphs and path.exists():
            try:
                with path.open("rb") as f:
                    self.graphs[kind] = torch.compiler.load_compiled_function(f)
            except Exception as error:  # a damaged or foreign file raises whatever its unpickling meets
                print(f"minilade: compiling again: {path} did not load ({one_line(error)})", file=sys.stderr)
        return kind in self.graphs

    def _load_or_compile(self, kind: str, args: tuple) -> Callable[..., torch.Tensor]:
        if self.load(kind):
            return self.graphs[kind]
        print(f"minilade: compiling the graph of {kind.split('|')[0]}...", end="", file=sys.stderr, flush=True)
        start = time.perf_counter()
        graph = self.compile(kind, args)
        print(f" {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        return graph

    def compile(self, kind: str, args: tuple) -> Callable[..., torch.Tensor]:
        """Trace and compile the graph of a kind from one call's arguments, and save it (replacing the same graph
        traced from other code)."""
        # One graph must serve every later call of its kind, and aot_compile sees one call: every size that changes
        # from call to call is marked dynamic, as torch.compile would find from a second one. (The cache views are
        # never the whole buffer, PaddedKVCache's spare chunk sees to it: traced from a whole one, a graph demands
        # contiguous views, from a part, parts.)
        self.mark(args)
        with tracing_config():
            graph = torch.compile(self.traced, fullgraph=True).aot_compile((args, {}))
        graph_name, path = self.path(kind)
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        graph.save_compiled_function(str(partial))
        os.replace(partial, path)  # whole or absent, never half-written
        for stale in self.folder.glob(f"{graph_name}-*.pt2"):  # the same graph traced from other code
            if stale != path:
                stale.unlink(missing_ok=True)
        return graph


def compile_at_once(jobs: list[tuple[SavedGraphs, str, tuple]], what: str) -> None:
    """Compile the graphs of several kinds, (SavedGraphs, kind, one call's arguments) each, in about half the time
    they take one after another: every other one in a forked process, which only traces and saves (its kinds load
    when first asked for), the rest here. Tracing and lowering a graph is Python, one core's work (some 10-40 s a
    graph for the demo model on 2 cores). Kinds already kept are skipped; what: the graphs, as a line names them.

    The second process runs no kernel: the arguments are made before the fork (a trace sees shapes), so it needs none
    of the OpenMP threads a fork does not copy (and keeps torch's thread count, which a graph's guards check). If it
    fails, a line says so and its kinds are compiled where first needed, as without this. Where there is no fork (not
    Linux) or one core, every kind is compiled here."""
    jobs = [(graphs, kind, args) for graphs, kind, args in jobs if not graphs.kept(kind)]
    if not jobs:
        return
    fork = sys.platform == "linux" and (os.cpu_count() or 1) > 1 and len(jobs) > 1
    print(f"minilade: compiling the graphs of {what}{' (in two processes)' if fork else ''}...", end="",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    here, there = (jobs[0::2], jobs[1::2]) if fork else (jobs, [])
    pid = os.fork() if there else None
    if pid == 0:  # the second process: trace, save, and go without running any exit handler
        status = 1
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the parent speaks for both
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = 1  # C++ compiled here, not by workers the parent may have started
            for graphs, kind, args in there:
                graphs.compile(kind, args)
            status = 0
        finally:
            os._exit(status)
    failed = None
    try:
        for graphs, kind, args in here:
            graphs.graphs[kind] = graphs.compile(kind, args)
    finally:
        if pid is not None:
            failed = wait_or_kill(pid, bound_s=2 * (time.perf_counter() - start) + 30)
    print(f" {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if failed:
        print(f"minilade: the second process did not save its graphs ({failed}); they are compiled where first "
              f"needed", file=sys.stderr, flush=True)


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


def modes_kind(what: str) -> str:
    """A kind of graph: what it serves, and the autograd and inference modes it runs in (its guards check them)."""
    return f"{what}|grad {torch.is_grad_enabled()}|inference {torch.is_inference_mode_enabled()}"


@functools.cache
def traced_code_digest() -> str:
    """A digest of the source files a layer's graph is traced from."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in TRACED_FROM)).hexdigest()
