#!/usr/bin/env python3
"""The floor under one autoregressive decode step: the model's weight matmuls alone, for one token.

Every 2-D weight of the model (the tied embedding once, as the output head) multiplies a (1, in) activation, in
each --dtypes, back to back with nothing else in between. Any implementation that calls torch's matmul kernels
pays at least this per token; the rest of a real step (attention, norms, rotary, Python) comes on top. Compare
with `scripts/benchmark.py ar`.

    python scripts/matmul_floor.py --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from minilade import LLM
from minilade.checkpoints import DEFAULT_CHECKPOINT


def matmul_seconds(weights: list[torch.Tensor], reps: int) -> float:
    """Median seconds of one pass of (1, in) @ W.T over all weights, after a warm-up pass."""
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    llm = LLM.load(args.ckpt, dtype="float32", device="cpu", progress=False, pack=False)
    matrices = [w for w in llm.model.parameters() if w.dim() == 2]
    print(f"{len(matrices)} weight matrices, {sum(w.numel() for w in matrices) / 1e6:.1f} M parameters, "
          f"{torch.get_num_threads()} threads\n")
    print("| dtype | weight MB | matmuls only, ms/token | tokens/s ceiling | weight GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for dtype in args.dtypes:
        weights = [w.detach().to(getattr(torch, dtype)).contiguous() for w in matrices]
        seconds = matmul_seconds(weights, args.reps)
        size = sum(w.numel() * w.element_size() for w in weights)
        print(f"| {dtype} | {size / 1e6:.0f} | {1e3 * seconds:.1f} | {1 / seconds:.1f} | {size / seconds / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
