"""The calls of several generations as one native pass, each call with the bits of its own step.

Where the model's steps are native layers (native_steps.py), one pass of `native_steps.layers_pass` takes the rows of
any number of calls of any widths, each over its own cache and mask: the weight matmuls read the weights once for
all rows, and each row's other operations, attention included, are its own. `NativePasses` runs every call of an
engine pass that way, the parts of prompts being read included (native steps run prefills too, so a prompt part is
a native call like a decoding step), then the final norm and the output head over every call's logits rows at once
(`native_steps.logits`).

A call's rows get what its step alone gives them: the operator computes a row the same way whatever else the pass
holds, its final norm and head included. `NativePasses.checked` still runs a pass of three probe calls of unequal
widths against each call alone, bit for bit, before the engine uses it.
"""

from __future__ import annotations

import sys
import weakref

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from ..native_steps import NativeCall, NativeSteps, layers_pass, logits
from ..sampling import carried_choices, with_choices
from .batched import ForwardCall
from .compiled_pass import PROBE_ROOM, calls_over, same_as_alone
from .planner import rows_together

_VERDICTS: weakref.WeakKeyDictionary[Transformer, bool] = weakref.WeakKeyDictionary()  # NativePasses.checked's


class NativePasses:
    """Runs the calls of a pass as one native pass (module docstring), for a model whose steps are native.
    It has the engine's interface to shared passes (compiled_pass.SharedPasses has the same)."""

    what = "native passes"  # for the user

    @classmethod
    def checked(cls, model: Transformer) -> NativePasses | None:
        """NativePasses where a pass of probe calls of 1, 3 and 2 rows gives each call its own step's logits and cache
        rows bit for bit, else None (with a line saying so); None at once where the model's steps are not native.
        The verdict is kept for the model's life: every engine made for it (each LLM.generate_many) asks again, and
        the check costs a few hundred milliseconds."""
        if not isinstance(model.step_runner, NativeSteps):
            return None
        if model not in _VERDICTS:
            _VERDICTS[model] = cls._check(model)
        return cls() if _VERDICTS[model] else None

    @classmethod
    def _check(cls, model: Transformer) -> bool:
        sizes = [(9, 1), (40, 3), (17, 2)]
        if max(past + T for past, T in sizes) + PROBE_ROOM > model.config.max_seq_len:
            return True  # no room for the probes in so short a context; the operator's design is the guarantee
        together, alone = calls_over(model, sizes), calls_over(model, sizes)
        with torch.inference_mode():
            got = cls()(model, together)
            want = [model(c.tokens, c.input_pos, c.cache, c.mask) for c in alone]
        if not same_as_alone(together, got, alone, want):
            print("minilade: served requests' native steps run one after another (a shared pass did not give each "
                  "call its own step's logits)", file=sys.stderr)
            return False
        return True

    def __call__(self, model: Transformer, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """Logits of each call, (1, R_i, V), from one native pass over all their rows, each carrying its rows' greedy
        choices where the head made them (sampling.with_choices); each call's keys and values written into its cache
        at [length, length + T_i)."""
        x = layers_pass(model, [NativeCall(c.tokens[0], c.input_pos.reshape(-1), c.cache, c.mask) for c in calls])
        picked, counts, start = [], [], 0
        for call in calls:
            T = call.tokens.shape[1]
            rows = call.logits_rows if call.logits_rows is not None else torch.arange(T, device=x.device)
            picked.append(x[start:start + T][rows])
            counts.append(picked[-1].shape[0])
            start += T
        together = logits(model, torch.cat(picked))
        parts = together.split(counts, dim=1)
        choices = carried_choices(together)  # each row's greedy choice, where the head made them
        if choices is None:
            return list(parts)
        return [with_choices(part, chosen) for part, chosen in zip(parts, choices.split(counts, dim=1))]

    # planner.PassCost: one step of every row the pass's generations feed (native steps run prompt parts too)
    pass_cost = staticmethod(rows_together)

    @staticmethod
    def groups(rows: list[int]) -> list[list[int]]:
        """Indices of the calls of `rows` rows each, in the passes that run them: all in one."""
        return [list(range(len(rows)))] if rows else []

    def release(self, cache: KVCache) -> None:
        """Nothing to release: each call's cache is its own."""
