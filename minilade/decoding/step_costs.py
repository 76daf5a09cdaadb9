"""What a decoding step costs on this machine as a function of the tokens it feeds: measured, interpolated, kept."""

from __future__ import annotations

import itertools
import math
import secrets
import time
import weakref
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from ..frame_stack import on_fresh_frame_chunk
from ..invariance import KERNELS_VERSION
from ..masks import CandidateTree, LookaheadLayout, StepShape
from ..memo import measuring, processor, read_table, write_entry
from ..model import Transformer
from ..sampling import Sampler, SamplingParams
from .autoregressive import AutoregressiveDecoder
from .base import Agree, DecodeContext, single_process
from .lookahead import packed_step


def measure_step_costs(model: Transformer, sizes: Iterable[int], *, context: int = 256, repeats: int = 3
                       ) -> dict[int, float]:
    """Median seconds of one decoding step of T tokens after `context` committed tokens, for each T in sizes,
    timed as decoding runs it, host work included: one row is a plain step (the forward and the pick of its
    token); more rows are x and T - 1 draft tokens in chains of up to DRAFT_CHAIN, put through lookahead.packed_step
    (the step's mask, the forward over the tree-masked rows, verification, keeping the accepted rows' keys and
    values). A drafted step's host work (some tenths of a millisecond in Python) is a cost the plan must weigh as
    much as the forward's.

    Sizes are measured round-robin, after one warm-up round, widest first, one sample a size a round (PLAIN_SAMPLES
    of the plain step); each sample is a step after PLAIN_BEFORE plain ones, as decoding's steps mostly follow
    plain steps: a pass after a much wider one runs slower for a few passes (a one-row pass right after a 30-row
    one by some 20%, the third after it by 5%), which a round of ascending sizes would charge to the narrow ones,
    making a few drafted rows look nearly free against a plain step. The context shrinks so that the steps'
    positions fit the model's."""
    return compare_step_costs({None: model}, sizes, context=context, repeats=repeats)[None]


def compare_step_costs(models: dict, sizes: Iterable[int], *, context: int = 256, repeats: int = 3
                       ) -> dict[object, dict[int, float]]:
    """measure_step_costs for several models at once, by name: each round times every size of every model in
    turn, so that a slow spell of a shared machine falls on all of them alike."""
    sizes = sorted(set(sizes), reverse=True)
    timers = {name: _StepTimer(model, max(sizes), context) for name, model in models.items()}
    samples: dict = {name: {T: [] for T in sorted(sizes)} for name in models}
    for rep in range(repeats + 1):
        for name, timer in timers.items():
            for T in sizes:
                for _ in range(PLAIN_BEFORE):
                    timer.time(1)
                for _ in range(PLAIN_SAMPLES if T == 1 else 1):
                    seconds = timer.time(T)
                    if rep:  # the first round is warm-up
                        samples[name][T].append(seconds)
    return {name: {T: sorted(s)[len(s) // 2] for T, s in by_size.items()} for name, by_size in samples.items()}


PLAIN_BEFORE = 2  # plain steps before each timed one
# Samples of a plain step a round: every plan is weighed against it, and a few of its samples on a noisy machine
# made a table whose plain step cost more than its 2-row one (a drafted row then looks free).
PLAIN_SAMPLES = 5
DRAFT_CHAIN = 4  # the longest draft path of a timed step (the paths of auto's steps are mostly this short or shorter)
# The version of a decoding step's host work (its masks, verification and cache compaction), part of the key of kept
# costs: a change to that work makes kept tables stale, and they are measured again.
HOST_VERSION = 3


class _StepTimer:
    """Times greedy decoding steps of random tokens over one prefilled cache, rolled back after each step."""

    def __init__(self, model: Transformer, max_rows: int, context: int) -> None:
        self.model = model
        self.context = max(0, min(context, model.config.max_seq_len - DRAFT_CHAIN - 1))
        self.gen = torch.Generator().manual_seed(0)
        with torch.inference_mode(False):  # a cache as generation makes one, even when measured inside a generation
            cache = model.new_cache(self.context + max_rows)
        self.ctx = DecodeContext(model, cache, Sampler(SamplingParams(), model.device), [], model.config.max_seq_len)
        self.plain = AutoregressiveDecoder(self.ctx)  # its steps are Decoder.single_step, as every plain step
        self.verify_shape = StepShape(LookaheadLayout(window=1, ngram=2, guesses=0), with_window=False,
                                      device=model.device)
        if self.context > 0:
            device = model.device
            with torch.inference_mode():
                model(self.random_tokens(self.context)[None].to(device), torch.arange(self.context, device=device),
                      cache, logits_rows=torch.zeros(1, dtype=torch.long, device=device))
            cache.commit(self.context)

    def random_tokens(self, n: int) -> torch.Tensor:
        return torch.randint(self.model.config.vocab_size, (n,), generator=self.gen)

    def time(self, T: int) -> float:
        """Seconds of one step of T rows: x and T - 1 draft tokens in paths of up to DRAFT_CHAIN, with distinct
        first tokens so that no two paths share a node of the trie (on any vocabulary of at least (T - 1) / DRAFT_CHAIN
        tokens)."""
        tokens = self.random_tokens(T).tolist()
        paths = [tokens[i:i + DRAFT_CHAIN] for i in range(1, T, DRAFT_CHAIN)]
        for path, first in zip(paths, torch.randperm(self.model.config.vocab_size, generator=self.gen).tolist()):
            path[0] = first
        self.ctx.tokens[:] = tokens[:1]  # x, the step's input
        with torch.inference_mode():
            start = time.perf_counter()  # from a fresh frame-stack chunk, as the decoding loop runs its steps
            on_fresh_frame_chunk(self._step, paths)
            seconds = time.perf_counter() - start
        self.ctx.cache.truncate(self.context)
        return seconds

    def _step(self, paths: list[list[int]]) -> None:
        if paths:
            packed_step(self.ctx, self.verify_shape, torch.tensor(self.ctx.tokens), CandidateTree.of(paths))
        else:
            self.plain.single_step()


class StepCosts:
    """Seconds per forward pass as a function of the tokens it feeds, interpolated between measured sizes."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.sizes = sorted(seconds)
        # A step never costs less than a smaller one: a measured dip (noise on a shared machine, or a kernel's
        # padding) is lifted to the cost below it, so that a plan never takes extra rows for a saving.
        self.seconds = list(itertools.accumulate((seconds[T] for T in self.sizes), max))
        self._memo: dict[int, float] = {}

    def __call__(self, tokens: int) -> float:
        if tokens not in self._memo:
            self._memo[tokens] = self._interpolate(tokens)
        return self._memo[tokens]

    def _interpolate(self, tokens: int) -> float:
        sizes, secs = self.sizes, self.seconds
        if tokens <= sizes[0]:
            return secs[0]
        for (t0, s0), (t1, s1) in zip(zip(sizes, secs), zip(sizes[1:], secs[1:])):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        return secs[-1] * tokens / sizes[-1]  # beyond the largest size: proportional


_MEASURED: "weakref.WeakKeyDictionary[Transformer, dict[int, float]]" = weakref.WeakKeyDictionary()
# The most a step may cost against a wider one in a table that is kept. Measured while something else runs on the
# machine, a step can come out several times dearer than a wider one; kept and lifted (StepCosts), such dips would
# make every wider step look free for good.
PLAUSIBLE_DIP = 1.25


def plausible(seconds: dict[int, float]) -> bool:
    """Whether no step of the table costs more than PLAUSIBLE_DIP times a wider one."""
    by_size = [seconds[T] for T in sorted(seconds)]
    return all(a <= PLAUSIBLE_DIP * min(by_size[i + 1:]) for i, a in enumerate(by_size[:-1]))


def step_costs_for(model: Transformer, sizes: Sequence[int], cost_file: str | Path | None = None, *,
                   agree: Agree = single_process) -> StepCosts:
    """Step costs for this model, measured once per process (and per file, when one is given). A measured table that
    is not plausible (a step dearer than PLAUSIBLE_DIP times a wider one: measured while something else ran) is
    measured again, all of it, once, before it is kept. A kept table is used as it is: auto's plans, and with them a
    seeded sampled answer, must be the same in every process that reads the file (the server's and the CLI's).
    agree: rank 0's value of what it is given (DecodeContext.agree): the ranks of a sharded model measure together
    and step by rank 0's figures, which rank 0 alone keeps in the file."""
    known = _MEASURED.setdefault(model, {})
    key = cost_key(model)
    if cost_file is not None and not set(sizes) <= set(known):
        known.update((_read_costs(Path(cost_file)) or {}).get(key, {}))
    ticket = secrets.randbits(64)  # rank 0 is the one process that gets its own ticket back
    missing, first_ticket = agree(([T for T in sizes if T not in known], ticket))
    if missing:
        kept_in = cost_file if first_ticket == ticket else None  # rank 0 keeps them, and says so
        with measuring(f"what steps of 1 to {max(missing)} rows cost", kept_in):
            known.update(measure_step_costs(model, sorted(set(missing) | {1})))
            if not agree(plausible(known)):
                known.clear()
                known.update(measure_step_costs(model, sorted(set(sizes) | {1})))
        if kept_in is not None:
            _write_costs(Path(kept_in), key, known)
    return StepCosts(agree({T: known.get(T, 0.0) for T in set(sizes) | {1}}))


def cost_key(model: Transformer) -> str:
    """What the cost of a step depends on: the model's shape, dtype, quantized layers, how its steps run (eager or
    compiled), device (the processor, on the CPU), the torch build, the version of a step's host work and that of
    minilade's step kernels. (device.make_exact keeps its verdicts under the same key: they depend on the same
    things but the host work.)"""
    c = model.config
    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else f"cpu {processor()}"
    quantized = quantized_layers(model)
    steps = f"|{model.step_runner.name} steps" if model.step_runner is not None else ""  # compiled.py's
    return (f"L{c.n_layers}-d{c.dim}-h{c.n_heads}/{c.n_kv_heads}-ff{c.intermediate_size}-v{c.vocab_size}|"
            f"{model.dtype}{f' ({quantized})' if quantized else ''}{steps}|{device}|threads {torch.get_num_threads()}|"
            f"torch {torch.__version__}|steps as decoding runs them|host {HOST_VERSION}|kernels {KERNELS_VERSION}")


def quantized_layers(model: nn.Module) -> str:
    """How the model's quantized layers compute, in a few words ("" when none is), e.g. "embedding int8 g32, int4 g32
    bfloat16": each such layer says so itself (`quantized_as`, minilade/quant.py)."""
    return ", ".join(sorted({layer.quantized_as for layer in model.modules() if hasattr(layer, "quantized_as")}))


def _read_costs(path: Path) -> dict[str, dict[int, float]] | None:
    """The cost table kept in `path`: {} when there is no file yet, None when the file is not a cost table.
    Entries that are not a positive whole size with positive, finite seconds are left out (measured again)."""
    raw = read_table(path)
    if raw is None or not all(isinstance(v, dict) for v in raw.values()):
        return None
    return {key: {int(t): float(s) for t, s in entries.items() if _valid_entry(t, s)} for key, entries in raw.items()}


def _valid_entry(tokens: str, seconds: object) -> bool:
    return (tokens.isdigit() and int(tokens) > 0 and isinstance(seconds, (int, float))
            and not isinstance(seconds, bool) and 0 < seconds < math.inf)


def _write_costs(path: Path, key: str, seconds: dict[int, float]) -> None:
    if _read_costs(path) is None:
        raise ValueError(f"{path} is not a step-cost table; refusing to overwrite it (give auto another cost_file)")
    write_entry(path, key, seconds)
