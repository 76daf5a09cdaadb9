"""The caches of served generations as slots of one buffer, and their one-row steps as one compiled pass.

A generation makes its own cache (decoding.loop.cache_for), a PaddedKVCache of one sequence. When its compiled
one-row steps first share a pass with others, `CachePool.place` adopts the cache: its committed rows are copied into
a free slot of the pool's buffer, (n_layers, slots, Hkv, capacity, ...), and the cache's k and v become views of that
slot, so the generation goes on writing and reading there unaware. `CachePool.run` then runs a pass of one-row calls
as pool_step.pool_layers_step over the first slots of the buffer: one graph for all of them. The buffer
grows (slots and capacity, by half at least: copied, and every adopted cache pointed at its new place) when a cache
does not fit; it is only touched between passes, in the engine's thread, while every generation waits in a forward
call. A finished generation's slot is released for the next; the rows it leaves there are scratch to the next
(finite, as a PaddedKVCache's unwritten slots are, so hidden keys still weigh exactly 0). The buffer holds its slots
at the largest capacity adopted (a request's own need: its prompt and max_tokens) and is freed when no slot is held.
"""

from __future__ import annotations

import threading

import torch

from ..compiled import CompiledSteps
from ..decoding.step_costs import cost_key
from ..invariance import PaddedKVCache
from ..kv_cache import KVCache
from ..model import Transformer
from ..pool_step import mark_pool_sizes, pool_layers_step, stack_layouts
from ..saved_graphs import SavedGraphs, modes_kind
from .batched import ForwardCall


class CachePool:
    """Slots of one buffer holding the caches of generations (module docstring)."""

    def __init__(self, model: Transformer, graphs: SavedGraphs | None = None) -> None:
        """graphs: the pool passes' graphs of another pool of this model, to share rather than load again."""
        runner = model.step_runner
        if not isinstance(runner, CompiledSteps) or runner.graphs is None:
            raise ValueError("a cache pool's passes need the model's steps compiled and kept in a folder")
        self.model, self.runner = model, runner
        self.graphs = graphs if graphs is not None else SavedGraphs(
            runner.graphs, f"{cost_key(model)}|pool", traced=pool_layers_step, mark=mark_pool_sizes)
        self.buffer: PaddedKVCache | None = None
        self.layer_keys: list[torch.Tensor] = []  # per layer, (slots, Hkv, S, D): views of the buffer (layer_views)
        self.layer_values: list[torch.Tensor] = []
        self.held: dict[int, KVCache] = {}  # slot -> the cache adopted there
        self.lock = threading.Lock()  # release comes from a worker's thread
        # what a slot without a call in the pass computes: a one-row step over one committed row
        self.dummy = runner.step_layout(model, torch.ones(1, 1, dtype=torch.long, device=model.device), 1, None)

    @staticmethod
    def kind() -> str:
        return modes_kind("passes of one-row calls over a cache pool")

    # ---- slots ----------------------------------------------------------------------------------------------

    def slot_of(self, cache: KVCache) -> int | None:
        with self.lock:
            return next((b for b, held in self.held.items() if held is cache), None)

    def place(self, caches: list[KVCache]) -> list[int]:
        """The slot of each cache (PaddedKVCache of one sequence), adopting those not yet held into free slots."""
        with self.lock:
            where = {id(cache): b for b, cache in self.held.items()}
            new = [cache for cache in caches if id(cache) not in where]
            if new:
                free = [b for b in range(len(self.held) + len(new)) if b not in self.held]
                for b, cache in zip(free, new):
                    self.held[b] = cache
                    where[id(cache)] = b
                self.fit(adopted=new)
            return [where[id(cache)] for cache in caches]

    def release(self, cache: KVCache) -> None:
        """Free a finished generation's slot (nothing happens to a cache never adopted); the buffer itself once no
        slot is held, so that a burst of long requests does not keep its memory after it."""
        with self.lock:
            for b, held in list(self.held.items()):
                if held is cache:
                    del self.held[b]
            if not self.held:
                self.buffer, self.layer_keys, self.layer_values = None, [], []

    def fit(self, adopted: list[KVCache]) -> None:
        """Make the buffer hold every slot in use at every held cache's capacity (a new one, the held rows copied,
        where it does not), then copy the adopted caches' rows in and point every moved cache at its slot."""
        slots = max(self.held) + 1
        capacity = max(cache.capacity for cache in self.held.values())
        old = self.buffer
        moved = list(adopted)
        if old is None or old.k.shape[1] < slots or old.capacity < capacity:
            if old is not None:  # grown by half at least: few buffers made (and copied) while requests arrive
                slots = max(slots, old.k.shape[1], -(-3 * old.k.shape[1] // 2))
                capacity = max(capacity, old.capacity, 3 * old.capacity // 2)
            with torch.inference_mode(False):  # tensors of the same kind whichever mode the pass runs in
                self.buffer = PaddedKVCache(self.model.config, capacity, batch_size=slots, dtype=self.model.dtype,
                                            device=self.model.device)
                self.layer_keys = [torch.from_numpy(t) for t in self.buffer.k.numpy()]
                self.layer_values = [torch.from_numpy(t) for t in self.buffer.v.numpy()]
            moved = list(self.held.values())
        for b, cache in self.held.items():
            if any(cache is m for m in moved):
                n = cache.length
                self.buffer.k[:, b, :, :n] = cache.k[:, 0, :, :n]
                self.buffer.v[:, b, :, :n] = cache.v[:, 0, :, :n]
                own = cache.k.shape[3]
                cache.k, cache.v = self.buffer.k[:, b:b + 1, :, :own], self.buffer.v[:, b:b + 1, :, :own]
                self.runner.layers.pop(cache, None)  # its per-layer views were of its old memory

    # ---- passes ---------------------------------------------------------------------------------------------

    def run(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """Logits of each one-row call, (1, R_i, V), as its own compiled step gives them: one pass over the slots
        [0, last used) of the buffer, the calls' caches adopted first."""
        model = self.model
        slots = self.place([c.cache for c in calls])
        args = self.pass_args(calls, slots)
        x = self.graphs.graph(self.kind(), args)(*args)
        rows = [b + (c.logits_rows if c.logits_rows is not None else torch.arange(1, device=x.device))
                for b, c in zip(slots, calls)]  # a call's row is its slot's
        logits = model.output(model.norm(x[torch.cat(rows), 0][None]))
        return list(logits.split([r.numel() for r in rows], dim=1))

    def pass_args(self, calls: list[ForwardCall], slots: list[int]) -> tuple:
        """The pass's host code, for one-row calls held in `slots`: pool_layers_step's arguments over the slots
        [0, n) (their embedded rows, rotary tables, writes and members, every layer's buffers cut to the pass's slots
        and keys: fresh views, since a view a graph was traced from keeps dynamo's marks, and their stacked
        layouts)."""
        model = self.model
        n = max(slots) + 1
        ids, positions, writes = (torch.zeros(n, dtype=torch.long, device=model.device) for _ in range(3))
        layouts = [self.dummy] * n
        for b, call in zip(slots, calls):
            position = call.input_pos.reshape(1, 1)
            ids[b], positions[b], writes[b] = call.tokens[0, 0], position[0, 0], call.cache.length
            layouts[b] = self.runner.step_layout(model, position, call.cache.length, call.mask)
        member = torch.zeros(n, device=model.device)
        member[slots] = 1
        layout = stack_layouts(layouts)
        Sp = layout[0].shape[-1]
        x = model.tok_embeddings(ids[:, None]).to(model.dtype).clone(memory_format=torch.contiguous_format)
        cos, sin = (t.clone(memory_format=torch.contiguous_format) for t in model.rotary(positions[:, None]))
        keys = [t[:n, :, :Sp] for t in self.layer_keys]
        values = [t[:n, :, :Sp] for t in self.layer_values]
        return model.layers, x, cos, sin, writes, member, keys, values, *layout
