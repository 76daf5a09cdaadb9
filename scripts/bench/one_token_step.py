"""The one-token step of plain decoding, alone: median milliseconds per step after a fixed context, against the
weight-read floor (the bytes of weights a step reads over this machine's memory bandwidth, measured here).

    python -m scripts.bench.one_token_step --quantize w7a8 --compile auto   # the default configuration's step

Prints one JSON line. It imports nothing from scripts/, so it runs against any checkout of the project, to
compare code before and after a change on the same machine, interleaved (one process a run; alternate the
checkouts and take medians; S is a copy of this file outside scripts/bench, where scripts/bench/cuda.py would
stand in for the `cuda` module torch imports):

    S=$(mktemp --suffix .py) && cp scripts/bench/one_token_step.py $S
    for round in 1 2 3; do
      for tree in ../old ../new; do (cd $tree && PYTHONPATH=$PWD python $S --quantize none); done
      (cd ../new && PYTHONPATH=$PWD python $S --quantize int4)
    done
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import NoReturn, Sequence

import torch

from minilade import LLM
from minilade.checkpoints import DEFAULT_CHECKPOINT
from minilade.memo import cpu_fields, simd_flags
from minilade.model import Transformer


def cpu_flags() -> str:
    """The SIMD flags of the first processor in /proc/cpuinfo (empty elsewhere)."""
    return " ".join(simd_flags(cpu_fields().get("flags", "")))


class StepParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit status 2, like the jobs of scripts.bench.common (which
    this file cannot import)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def step_parser(description: str, steps: int) -> StepParser:
    """The options of the jobs that time one-token steps of the real model (this one and compile_regions)."""
    p = StepParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT)
    p.add_argument("--quantize", choices=["none", "int8", "int4", "w7a8"], default="none")
    p.add_argument("--context", type=positive, default=100)
    p.add_argument("--steps", type=positive, default=steps)
    p.add_argument("--threads", type=positive, default=2)
    return p


def load_model(args: argparse.Namespace, compile: bool | str = False) -> Transformer:
    """The model as LLM.load runs it (float32 around any quantized layers; compile as LLM.load takes it), on
    args.threads torch threads; a checkpoint that is missing, corrupt or unsupported ends the job in one line (exit
    status 2)."""
    torch.set_num_threads(args.threads)
    quantize = None if args.quantize == "none" else args.quantize
    try:
        return LLM.load(args.ckpt, dtype="float32", quantize=quantize, progress=False, compile=compile).model
    except ValueError as e:  # minilade's errors about a checkpoint are ValueErrors (minilade.errors)
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None


def step_weight_bytes(model: Transformer) -> int:
    """Bytes of weights a one-token step reads: every parameter and buffer once (a storage shared by two modules
    counts once) and the weights kept packed outside them (w7a8 layers), but not the token embedding's table, of
    which a step reads one row (a head tied to it has a storage or packed weight of its own, counted)."""
    lookup = set(model.tok_embeddings.modules())
    storages = {}
    for module in model.modules():
        if module in lookup:
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    packed = sum(m.weight_bytes() for m in model.modules() if m not in lookup and hasattr(m, "weight_bytes"))
    return sum(storages.values()) + packed


def read_bandwidth(mib: int, reps: int = 5) -> float:
    """This machine's memory bandwidth in GB/s (1e9 bytes/s) on torch's threads: a sum over a buffer of `mib` MiB,
    the median of reps after one that warms up."""
    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times[1:]) / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    p = step_parser(__doc__, steps=70)
    p.add_argument("--compile", choices=["off", "auto", "on"], default="off",
                   help="compiled steps as LLM.load's compile takes them (auto: where exact and faster)")
    p.add_argument("--bandwidth-mib", type=positive, default=1024, help="the buffer the bandwidth is read from")
    args = p.parse_args(argv)
    model = load_model(args, {"off": False, "auto": "auto", "on": True}[args.compile])
    warm_up = 10
    with torch.inference_mode():
        cache = model.new_cache(args.context + args.steps + warm_up)
        model(torch.randint(0, model.config.vocab_size, (1, args.context)), torch.arange(args.context), cache)
        cache.commit(args.context)
        token, times = torch.tensor([[5]]), []
        for i in range(warm_up + args.steps):
            start = time.perf_counter()
            logits = model(token, torch.tensor([cache.length]), cache)
            cache.commit(1)
            token = logits[:, -1:].argmax(-1)
            if i >= warm_up:
                times.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(times)
    weights, bandwidth = step_weight_bytes(model), read_bandwidth(args.bandwidth_mib)
    floor_ms = 1e3 * weights / (bandwidth * 1e9)
    compiled = getattr(model, "step_runner", None) is not None  # (a checkout from before compiled steps has none)
    print(json.dumps({"quantize": args.quantize, "compiled": compiled, "context": args.context, "ms": ms,
                      "weight_mb": weights / 1e6, "read_gb_s": bandwidth, "floor_ms": floor_ms,
                      "x_floor": ms / floor_ms, "threads": args.threads, "cpu_flags": cpu_flags()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
