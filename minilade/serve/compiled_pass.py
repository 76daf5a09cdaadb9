"""The steps of several generations through one compiled pass, each call with the bits of its own compiled step.

A model with compiled steps (compiled.py) runs each decoding step as one graph. Served together, the steps of K
generations could run one after another, each its own graph; `SharedPasses` runs them through
compiled.pass_layer_step instead, one graph a layer that reads the layer's weights once for the rows of every call
and has each call attend over its own cache. Measured on the demo model (w7a8, 2 cores, outside the repository):
two one-row calls 13.8 ms against 15.4 one after another, four 20-21 against 32.5, eight 39 against 70; four of 4
rows 35 against 51. Each call's own attention bounds the gain.

A graph serves one kind of group: so many calls, all one-row or all wider (inductor specialises a size of 1, so a
one-row call and a wider one take different code). A pass's calls go in groups of one kind of at most GROUP calls
(`groups`); a group of one is the call's own step. Each kind is compiled once per machine when first needed (some
10-25 s for the demo model on 2 cores, while every request waits) and kept beside the steps' graphs
(saved_graphs.SavedGraphs); the kinds kept are loaded when the engine starts. A kind is traced from probe calls whose
every size differs from call to call, not from the pass at hand: traced from calls of equal sizes, a graph would
demand them equal ever after.

Each call's rows get what its step alone gives them: the same operations row by row, the same weight matmuls
(row-count invariant: the load-time check) and its own attention. That is a claim about the compiler's code, so
`SharedPasses.checked` runs passes of two one-row and of two wider probe calls against each call alone, bit for bit,
and the engine shares compiled passes only where they hold.
"""

from __future__ import annotations

import sys

import torch

from ..compiled import CompiledSteps, mark_pass_sizes, pass_layer_step
from ..decoding.step_costs import cost_key
from ..errors import one_line
from ..masks import interleaved_step
from ..model import Transformer
from ..saved_graphs import SavedGraphs, modes_kind
from .batched import ForwardCall, one_after_another

GROUP = 4  # calls in a group at most: more a group, more kinds of graph to compile (module docstring)


class SharedPasses:
    """Runs the compiled calls of a pass in groups of one kind (module docstring), for a model whose steps are
    compiled graphs kept in a folder (CompiledSteps with graphs)."""

    def __init__(self, model: Transformer) -> None:
        runner = model.step_runner
        if not isinstance(runner, CompiledSteps) or runner.graphs is None:
            raise ValueError("shared compiled passes need the model's steps compiled and kept in a folder")
        self.runner = runner
        self.graphs = SavedGraphs(runner.graphs, f"{cost_key(model)}|pass", traced=pass_layer_step,
                                  mark=mark_pass_sizes)
        self.refused: set[str] = set()  # kinds whose graph refused a pass (run_group)

    @classmethod
    def checked(cls, model: Transformer) -> SharedPasses | None:
        """SharedPasses for the model where passes of two one-row and of two wider probe calls give each call its own
        step's logits and cache rows bit for bit, else None (with a line saying so); None at once where the model's
        steps are not compiled graphs kept in a folder."""
        runner = model.step_runner
        if not isinstance(runner, CompiledSteps) or runner.graphs is None:
            return None
        if probe_positions(GROUP, 3) > model.config.max_seq_len:
            print(f"minilade: served requests' compiled steps run one after another (the model's context of "
                  f"{model.config.max_seq_len} positions cannot hold the probe calls that compiled passes are traced "
                  f"from)", file=sys.stderr)
            return None
        passes = cls(model)
        with torch.inference_mode():  # the mode of the engine's passes, in which the graphs are kept
            for kind in passes.kinds():  # those a process before compiled, loaded now rather than amid a pass
                passes.graphs.load(kind)
        for rows in (1, 3):
            together, alone = probe_calls(model, 2, rows), probe_calls(model, 2, rows)
            with torch.inference_mode():
                got = passes.run_group(model, together)
                want = [model(c.tokens, c.input_pos, c.cache, c.mask) for c in alone]
            caches = [(a.cache, b.cache) for a, b in zip(together, alone)]
            same = all(torch.equal(a, b) for a, b in zip(got, want)) and all(
                torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in caches)
            if not same:
                print(f"minilade: served requests' compiled steps run one after another (a shared pass of "
                      f"{'one-row' if rows == 1 else 'wider'} calls did not give each its own step's logits)",
                      file=sys.stderr)
                return None
        return passes

    @staticmethod
    def kind(n: int, one_row: bool) -> str:
        """The kind of graph that serves a group of n calls, one-row or wider, in the current autograd and inference
        modes."""
        return modes_kind(f"passes of {n} {'one-row' if one_row else 'wider'} calls")

    def kinds(self) -> list[str]:
        """Every kind of graph a pass may need (groups of 2 to GROUP calls)."""
        return [self.kind(n, one_row) for n in range(2, GROUP + 1) for one_row in (True, False)]

    def __call__(self, model: Transformer, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """Logits of each call, (1, R_i, V), as its own compiled step gives them: one pass a group (groups)."""
        logits: list[torch.Tensor | None] = [None] * len(calls)
        for group in groups([call.tokens.shape[1] for call in calls]):
            for i, result in zip(group, self.run_group(model, [calls[i] for i in group])):
                logits[i] = result
        return logits

    def run_group(self, model: Transformer, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """One pass over calls of one kind (all one-row or all wider), their caches holding rows."""
        one_row = calls[0].tokens.shape[1] == 1
        kind = self.kind(len(calls), one_row)
        if len(calls) == 1 or kind in self.refused:
            return one_after_another(model, calls)
        if kind not in self.graphs.graphs:  # compiled (or loaded) from probe calls of unequal sizes
            x, cos, sin, steps = self.pass_inputs(model, probe_calls(model, len(calls), 1 if one_row else 3))
            self.graphs.graph(kind, layer_args(model.layers[0], x, cos, sin, steps, 0))
        graph = self.graphs.graphs[kind]
        x, cos, sin, steps = self.pass_inputs(model, calls)
        try:
            for layer, block in enumerate(model.layers):
                x = graph(*layer_args(block, x, cos, sin, steps, layer))
        except RuntimeError as error:
            if "GuardManager check failed" not in str(error):
                raise
            # Not met in the tests: calls whose sizes relate otherwise than the probes' did. Each call's own step
            # writes the same cache slots again, from the first layer.
            print(f"minilade: the graph of {kind.split('|')[0]} refuses a pass ({one_line(error)[:200]}); such "
                  f"calls run one after another from now on", file=sys.stderr)
            self.refused.add(kind)
            return one_after_another(model, calls)
        rows, start = [], 0
        for c in calls:
            T = c.tokens.shape[1]
            rows.append(start + (c.logits_rows if c.logits_rows is not None else torch.arange(T, device=x.device)))
            start += T
        logits = model.output(model.norm(x[:, torch.cat(rows)]))
        return list(logits.split([r.numel() for r in rows], dim=1))

    def pass_inputs(self, model: Transformer, calls: list[ForwardCall]) -> tuple:
        """x, cos, sin of all the calls' rows concatenated, and each call's step inputs (CompiledSteps.layers_inputs:
        its embedded rows, rotary tables, slots, cache views per layer and layout)."""
        steps = [self.runner.layers_inputs(model, c.tokens, c.input_pos.reshape(1, -1), c.cache, c.mask)
                 for c in calls]
        x, cos, sin = (torch.cat([step[i] for step in steps], dim=1) for i in (1, 2, 3))
        return x, cos, sin, steps


def layer_args(block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, steps: list[tuple],
               layer: int) -> tuple:
    """pass_layer_step's arguments for one layer: each call's slots, this layer's cache views and its layout."""
    return (block, x, cos, sin, *(t for _, _, _, _, slots, keys, values, *step_layout in steps
                                  for t in (slots, keys[layer], values[layer], *step_layout)))


def probe_calls(model: Transformer, n: int, rows: int) -> list[ForwardCall]:
    """n calls of `rows` rows each (lookahead-shaped when wider), over fresh caches of prompts of unequal lengths,
    the rows of wider calls unequal too: every size a graph of their kind makes dynamic differs between them."""
    calls = []
    for i in range(n):
        past, T = probe_size(i, rows)
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


def groups(rows: list[int]) -> list[list[int]]:
    """Indices of calls of `rows` rows each, in the groups a pass runs them in: one-row calls, then wider ones, at
    most GROUP a group."""
    out = []
    for one_row in (True, False):
        kind = [i for i, T in enumerate(rows) if (T == 1) == one_row]
        out += [kind[start:start + GROUP] for start in range(0, len(kind), GROUP)]
    return out
