"""The steps of several generations through shared compiled passes, each call with the bits of its own compiled step.

A model with compiled steps (compiled.py) runs each decoding step as one graph. Served together, the steps of K
generations could run one after another, each its own graph; `SharedPasses` runs them in shared passes instead:

- one-row calls (plain decoding, and auto between drafts), the most of a server's: one pass over a pool of their
  caches (cache_pool.py, pool_step.py), in which each layer runs every call's row through one graph, attention
  included;
- wider calls (drafted steps): groups of at most GROUP calls (and no more than the generations that run at once),
  each group one compiled.pass_layer_step a layer that reads the layer's weights once for all and has each call
  attend over its own cache with its own layout. Measured on the demo model (w7a8, 2 cores, outside the
  repository): two 4-row calls 35 ms against 51 one after another.

A graph serves one kind of pass: the pool's, or a group of so many wider calls. Each kind is compiled once per
machine (some 10-25 s for the demo model on 2 cores), every kind not kept yet when the engine starts, half of them
in a forked process (saved_graphs.compile_at_once), and kept beside the steps' graphs (saved_graphs.SavedGraphs),
whence a later engine loads them when it starts, not amid a pass. A kind is traced from probe calls whose every size
differs from call to call, not from the pass at hand: traced from calls of equal sizes, a graph would demand them
equal ever after.

Each call's rows get what its step alone gives them: the same operations row by row, the same weight matmuls
(row-count invariant: the load-time check) and the same sums in its attention. That is a claim about the compiler's
code, so `SharedPasses.checked` runs a pool pass of three one-row probe calls and a group of two wider ones against
each call alone, bit for bit, and the engine shares compiled passes only where they hold. The check, the graphs it
loads and the costs it measures (some 20 s for the demo model on 2 cores) are kept for the model's life: every
engine made for it (each LLM.generate_many) gets passes of its own, with a cache pool of its own, from them.
"""

from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ..compiled import CompiledSteps, mark_pass_sizes, pass_layer_step
from ..decoding.step_costs import cost_key
from ..errors import one_line
from ..kv_cache import KVCache
from ..masks import interleaved_step
from ..model import Transformer
from ..saved_graphs import SavedGraphs, compile_at_once, modes_kind
from .batched import ForwardCall, one_after_another
from .cache_pool import CachePool

GROUP = 4  # wider calls in a group at most: more a group, more kinds of graph to compile (module docstring)
# SharedPasses.checked's verdicts: per model, per largest group, what the check loaded and measured (Checked), or
# None where it failed. Nothing in a verdict refers to the model, which would keep it alive.
_CHECKED: weakref.WeakKeyDictionary[Transformer, dict[int, Checked | None]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Checked:
    """What SharedPasses.checked found for a model: the groups' and the pool's graphs it loaded, and the passes'
    costs it measured (SharedPasses.pool_costs, group_share)."""

    graphs: SavedGraphs
    pool_graphs: SavedGraphs
    pool_costs: tuple[float, float]
    group_share: float


class SharedPasses:
    """Runs the compiled calls of a pass in shared passes (module docstring), for a model whose steps are compiled
    graphs kept in a folder (CompiledSteps with graphs)."""

    what = "compiled passes"  # for the user

    def __init__(self, model: Transformer, largest_group: int = GROUP, checked: Checked | None = None) -> None:
        """largest_group: wider calls in a group at most (2 to GROUP), the kinds of group graph compiled.
        checked: what an earlier check of the model loaded and measured, to share (a cache pool of its own)."""
        runner = model.step_runner
        if not isinstance(runner, CompiledSteps) or runner.graphs is None:
            raise ValueError("shared compiled passes need the model's steps compiled and kept in a folder")
        self.runner = runner
        self.graphs = checked.graphs if checked is not None else SavedGraphs(
            runner.graphs, f"{cost_key(model)}|pass", traced=pass_layer_step, mark=mark_pass_sizes)
        self.pool = CachePool(model, checked.pool_graphs if checked is not None else None)
        self.largest_group = largest_group
        self.refused: set[str] = set()  # kinds whose graph refused a pass (unless_refused)
        # A pool pass of k >= 2 one-row calls costs (base + per_call * k) one-row steps; each wider call of a group
        # but the dearest, group_share of its step alone (measure_passes, in checked).
        self.pool_costs, self.group_share = ((checked.pool_costs, checked.group_share) if checked is not None
                                             else ((1.0, 0.5), 1.0))

    @classmethod
    def checked(cls, model: Transformer, max_calls: int = GROUP) -> SharedPasses | None:
        """SharedPasses for the model, for passes of at most max_calls calls (the generations that run at once),
        where a pool pass of three one-row probe calls and a group of two wider ones give each call its own step's
        logits and cache rows bit for bit, else None (with a line saying so); None at once where the model's steps
        are not compiled graphs kept in a folder, or where max_calls < 2 (no pass is shared). The check runs once
        for a model and largest group (Checked); each call gets passes of its own, a cache pool included."""
        runner = model.step_runner
        if not isinstance(runner, CompiledSteps) or runner.graphs is None or max_calls < 2:
            return None
        largest_group = min(GROUP, max_calls)
        if probe_positions(largest_group, 3) > model.config.max_seq_len:
            print(f"minilade: served requests' compiled steps run one after another (the model's context of "
                  f"{model.config.max_seq_len} positions cannot hold the probe calls that compiled passes are traced "
                  f"from)", file=sys.stderr)
            return None
        verdicts = _CHECKED.setdefault(model, {})
        if largest_group not in verdicts:
            verdicts[largest_group] = cls._check(model, largest_group)
        found = verdicts[largest_group]
        return cls(model, largest_group, found) if found is not None else None

    @classmethod
    def _check(cls, model: Transformer, largest_group: int) -> Checked | None:
        """checked()'s probes and measurements, for groups of at most largest_group wider calls."""
        passes = cls(model, largest_group)
        pool_calls, hole = probe_calls(model, 3, 1), probe_calls(model, 1, 1)[0].cache
        with torch.inference_mode():  # the mode of the engine's passes, in which the graphs are kept
            # in slots 0, 2 and 3 of the pool: slot 1 held by a cache without a call in the pass
            passes.pool.place([pool_calls[0].cache, hole])
            passes.compile_missing(model, pool_calls)
            for kind in passes.kinds():  # those compiled in another process, or before: loaded now, not amid a pass
                passes.graphs.load(kind)
            passes.pool.graphs.load(passes.pool.kind())
        for rows in (1, 3):
            together = pool_calls if rows == 1 else probe_calls(model, 2, rows)
            alone = probe_calls(model, len(together), rows)
            with torch.inference_mode():
                if rows == 1:
                    got = passes.pool.run(together)
                    for cache in [hole] + [call.cache for call in together]:
                        passes.pool.release(cache)
                else:
                    got = passes.run_group(model, together)
                want = [model(c.tokens, c.input_pos, c.cache, c.mask) for c in alone]
            if not same_as_alone(together, got, alone, want):
                print(f"minilade: served requests' compiled steps run one after another (a shared pass of "
                      f"{'one-row' if rows == 1 else 'wider'} calls did not give each its own step's logits)",
                      file=sys.stderr)
                return None
        pool_costs, group_share = measure_passes(model, passes)
        return Checked(passes.graphs, passes.pool.graphs, pool_costs, group_share)

    def pass_cost(self, other_rows: list[int], eager_rows: list[int], costs: Callable[[int], float]
                  ) -> Callable[[int], float]:
        """planner.PassCost: seconds of a pass whose other generations feed other_rows in decoding calls and
        eager_rows in parts of their prompts, by the rows this one feeds, one call's step alone costing costs(rows),
        the passes as groups() makes them: the pool's pass where two one-row calls or more share it (pool_costs,
        over a slot for every decoding generation: one whose call is wider keeps its slot and goes along with a
        dummy row), a lone one-row call its own step; the wider calls in groups of up to largest_group (group_cost); the
        prompts' parts, one eager pass of all their rows. A lone generation costs its own step."""
        prompts = costs(sum(eager_rows)) if eager_rows else 0.0
        if not other_rows:
            return lambda rows: prompts + costs(rows)
        base, per_call = self.pool_costs
        pool = costs(1) * (base + per_call * (len(other_rows) + 1))
        ones = sum(r == 1 for r in other_rows)  # the others' one-row calls
        wider = [costs(r) for r in other_rows if r > 1]
        size = self.largest_group
        full = len(wider) - len(wider) % size  # the others' calls in full groups; a wider call joins the rest
        fixed = prompts + sum(self.group_cost(wider[i:i + size]) for i in range(0, full, size))
        rest = wider[full:]
        plain = fixed + (pool if ones else costs(1)) + self.group_cost(rest)
        drafted = fixed + (pool if ones > 1 else costs(1) if ones else 0.0)
        return lambda rows: plain if rows == 1 else drafted + self.group_cost(rest + [costs(rows)])

    def group_cost(self, steps: list[float]) -> float:
        """Seconds of a group of wider calls whose steps alone take `steps`: the dearest step, and group_share of
        each other one (the group reads the weights once for all of them)."""
        return max(steps) + self.group_share * (sum(steps) - max(steps)) if steps else 0.0

    def compile_missing(self, model: Transformer, pool_calls: list[ForwardCall]) -> None:
        """Compile every kind of pass not kept yet, at once (saved_graphs.compile_at_once: about half the time), each
        from probe calls of unequal sizes: the pool's from pool_calls (one-row, their caches in the pool), groups of 2
        to largest_group wider calls from probe_calls."""
        jobs = []
        for n in range(self.largest_group, 1, -1):  # the largest first: the two processes take the kinds in turn
            if not self.graphs.kept(self.kind(n)):
                x, cos, sin, steps = self.pass_inputs(model, probe_calls(model, n, 3))
                jobs.append((self.graphs, self.kind(n), layer_args(model.layers[0], x, cos, sin, steps, 0)))
        if not self.pool.graphs.kept(self.pool.kind()):
            slots = self.pool.place([c.cache for c in pool_calls])
            jobs.append((self.pool.graphs, self.pool.kind(), self.pool.pass_args(pool_calls, slots)))
        compile_at_once(jobs, f"shared passes (one-row calls over a cache pool; groups of 2 to {self.largest_group} "
                              f"wider calls)")

    @staticmethod
    def kind(n: int) -> str:
        """The kind of graph that serves a group of n wider calls, in the current autograd and inference modes."""
        return modes_kind(f"passes of {n} wider calls")

    def kinds(self) -> list[str]:
        """Every kind of graph a group of wider calls may need (2 to largest_group calls)."""
        return [self.kind(n) for n in range(2, self.largest_group + 1)]

    def __call__(self, model: Transformer, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """Logits of each call, (1, R_i, V), as its own compiled step gives them: one pass a group (groups)."""
        logits: list[torch.Tensor | None] = [None] * len(calls)
        for group in self.groups([call.tokens.shape[1] for call in calls]):
            for i, result in zip(group, self.run_group(model, [calls[i] for i in group])):
                logits[i] = result
        return logits

    def run_group(self, model: Transformer, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """One pass over calls of one kind, their caches holding rows: one-row calls over the pool, wider ones as
        a group of their own (one alone: its own step)."""
        one_row = calls[0].tokens.shape[1] == 1
        kind = self.pool.kind() if one_row else self.kind(len(calls))
        if len(calls) == 1 or kind in self.refused:
            return one_after_another(model, calls)
        if one_row:
            return self.unless_refused(kind, model, calls, lambda: self.pool.run(calls))
        if kind not in self.graphs.graphs:  # compiled (or loaded) from probe calls of unequal sizes
            x, cos, sin, steps = self.pass_inputs(model, probe_calls(model, len(calls), 3))
            self.graphs.graph(kind, layer_args(model.layers[0], x, cos, sin, steps, 0))
        graph = self.graphs.graphs[kind]

        def run() -> list[torch.Tensor]:
            x, cos, sin, steps = self.pass_inputs(model, calls)
            for layer, block in enumerate(model.layers):
                x = graph(*layer_args(block, x, cos, sin, steps, layer))
            rows, start = [], 0
            for c in calls:
                T = c.tokens.shape[1]
                rows.append(start + (c.logits_rows if c.logits_rows is not None else torch.arange(T, device=x.device)))
                start += T
            logits = model.output(model.norm(x[:, torch.cat(rows)]))
            return list(logits.split([r.numel() for r in rows], dim=1))
        return self.unless_refused(kind, model, calls, run)

    def unless_refused(self, kind: str, model: Transformer, calls: list[ForwardCall],
                 run: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """run(), or where the kind's graph refuses the pass (its guards), the calls one after another, with a
        line, and every later pass of that kind too."""
        try:
            return run()
        except RuntimeError as error:
            if "GuardManager check failed" not in str(error):
                raise
            # Not met in the tests: calls whose sizes relate otherwise than the probes' did. Each call's own step
            # writes the same cache slots again, from the first layer.
            print(f"minilade: the graph of {kind.split('|')[0]} refuses a pass ({one_line(error)[:200]}); such "
                  f"calls run one after another from now on", file=sys.stderr)
            self.refused.add(kind)
            return one_after_another(model, calls)

    def groups(self, rows: list[int]) -> list[list[int]]:
        """Indices of the compiled calls of `rows` rows each, in the passes that run them (the module's groups)."""
        return groups(rows, self.largest_group)

    def release(self, cache: KVCache) -> None:
        """A finished generation's cache leaves the pool (cache_pool.CachePool.release)."""
        self.pool.release(cache)

    def pass_inputs(self, model: Transformer, calls: list[ForwardCall]) -> tuple:
        """x, cos, sin of all the calls' rows concatenated, and each call's step inputs (CompiledSteps.layers_inputs:
        its embedded rows, rotary tables, slots, cache views per layer and layout)."""
        steps = [self.runner.layers_inputs(model, c.tokens, c.input_pos.reshape(1, -1), c.cache, c.mask)
                 for c in calls]
        x, cos, sin = (torch.cat([step[i] for step in steps], dim=1) for i in (1, 2, 3))
        return x, cos, sin, steps


def measure_passes(model: Transformer, passes: SharedPasses, repeats: int = 5) -> tuple[tuple[float, float], float]:
    """((base, per_call), group_share): a pool pass of k one-row calls costs (base + per_call * k) one-row steps,
    and each wider call of a group but the dearest group_share of its step alone (SharedPasses.group_cost). From
    the median times of pool passes of two and four one-row calls, a one-row step alone, a group of largest_group
    lookahead-shaped calls of MEASURED_ROWS rows and those calls alone, measured round-robin after a warm-up round.
    Every call reads a cache of the same length (that of step_costs' measured steps, where the context holds it),
    since a pool pass attends over its widest slot's length: from calls over caches of unequal lengths, the pass of
    four would also pay for a wider slot, and per_call come out 1.5-2x what a slot costs."""
    past = max(1, min(MEASURED_CONTEXT, model.config.max_seq_len - MEASURED_ROWS - PROBE_ROOM))
    ones, wider = calls_over(model, [(past, 1)] * 4), calls_over(model, [(past, MEASURED_ROWS)] * passes.largest_group)
    runs = {"alone": lambda: one_after_another(model, ones[:1]), "two": lambda: passes.pool.run(ones[:2]),
            "four": lambda: passes.pool.run(ones), "group": lambda: passes.run_group(model, wider),
            "steps": lambda: one_after_another(model, wider)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
    for call in ones:
        passes.pool.release(call.cache)
    one, two, four, group, steps = (sorted(seconds[name])[repeats // 2] for name in runs)
    per_call = max(0.0, (four - two) / 2 / one)  # not below 0 where a noisy machine says so
    step = steps / passes.largest_group  # the calls are of one size
    return (max(0.0, two / one - 2 * per_call), per_call), min(1.0, max(0.0, (group - step) / (steps - step)))


MEASURED_CONTEXT = 256  # cache rows the measured passes' calls read (step_costs measures its steps after as many)
MEASURED_ROWS = 6  # rows of each wider call measured in a group


def layer_args(block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, steps: list[tuple],
               layer: int) -> tuple:
    """pass_layer_step's arguments for one layer: each call's slots, this layer's cache views and its layout."""
    return (block, x, cos, sin, *(t for _, _, _, _, slots, keys, values, *step_layout in steps
                                  for t in (slots, keys[layer], values[layer], *step_layout)))


def same_as_alone(together: list[ForwardCall], got: list[torch.Tensor], alone: list[ForwardCall],
                  want: list[torch.Tensor]) -> bool:
    """Whether calls run in a shared pass (together, their logits got) gave each the logits and written cache rows
    that the same calls run alone did (alone, want), bit for bit: the check a shared pass must pass before use."""
    written = [(a.cache, b.cache, a.cache.length + a.tokens.shape[1]) for a, b in zip(together, alone)]
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and all(
        torch.equal(a.k[:, :, :, :end], b.k[:, :, :, :end]) and torch.equal(a.v[:, :, :, :end], b.v[:, :, :, :end])
        for a, b, end in written)


def probe_calls(model: Transformer, n: int, rows: int) -> list[ForwardCall]:
    """n calls of `rows` rows each (lookahead-shaped when wider), over fresh caches of prompts of unequal lengths,
    the rows of wider calls unequal too: every size a graph of their kind makes dynamic differs between them."""
    return calls_over(model, [probe_size(i, rows) for i in range(n)])


def calls_over(model: Transformer, sizes: list[tuple[int, int]]) -> list[ForwardCall]:
    """A call of T rows (lookahead-shaped when T > 1) over a fresh cache holding a prompt of `past` tokens, for
    each (past, T) of sizes; the prompts' tokens differ from call to call."""
    calls = []
    for i, (past, T) in enumerate(sizes):
        with torch.inference_mode(False):  # a cache as generation makes one
            cache = model.new_cache(past + T + PROBE_ROOM)
        with torch.inference_mode():
            model((torch.arange(past, device=model.device)[None] * (7 + i)) % model.config.vocab_size,
                  torch.arange(past, device=model.device), cache)
            cache.commit(past)
        positions, mask = interleaved_step(past, T, lanes=2) if T > 1 else (torch.tensor([past]), None)
        tokens = (torch.arange(T, device=model.device)[None] * 3 + i) % model.config.vocab_size
        calls.append(ForwardCall(tokens, positions.to(model.device), cache,
                                 None if mask is None else mask.to(model.device)))
    return calls


PROBE_ROOM = 64  # cache slots a probe's cache holds past its step


def probe_size(i: int, rows: int) -> tuple[int, int]:
    """The i-th probe call's prompt length (a chunk count of its own, as 130 positions apart) and rows."""
    return 9 + 130 * i, rows + i if rows > 1 else 1


def probe_positions(n: int, rows: int) -> int:
    """Positions the caches of n probe calls of `rows` rows reach: the model's context must hold them."""
    past, T = probe_size(n - 1, rows)
    return past + T + PROBE_ROOM


def groups(rows: list[int], largest: int = GROUP) -> list[list[int]]:
    """Indices of calls of `rows` rows each, in the passes that run them: every one-row call in one (the pool's),
    then the wider ones, at most `largest` a pass."""
    one_row = [i for i, T in enumerate(rows) if T == 1]
    wider = [i for i, T in enumerate(rows) if T > 1]
    return ([one_row] if one_row else []) + [wider[start:start + largest] for start in range(0, len(wider), largest)]
