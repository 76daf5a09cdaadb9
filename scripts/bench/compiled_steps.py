"""Eager against compiled steps (minilade/compiled.py), and native ones (native_steps.py) for w7a8 layers, on the
real model, by rows per step.

For one weight configuration: the load-time exactness check run through the compiled steps (and the seconds it and
the first compiles took) and the native ones, then milliseconds of a step of T rows after 100 committed tokens, the
rows masked as a lookahead step's, each way interleaved in one process (medians of 7 after a warm-up); and the one-row
step against the weight-read floor: the bytes of weights a step reads over the memory read bandwidth measured here
(one_token_step's: a sum over a 1 GiB buffer, median of 5).

    python -m scripts.bench.compiled_steps int4     # or float32, bfloat16, int8, w7a8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minilade.compiled import compile_steps
from minilade.device import check_invariance
from minilade.llm import LLM
from minilade.masks import interleaved_step
from minilade.native_steps import NativeSteps, native_missing

from .one_token_step import cpu_flags, read_bandwidth, step_weight_bytes

SIZES = (1, 2, 4, 8, 16, 32, 64)


def step_ms(model, runners: dict, sizes=SIZES, repeats: int = 7, past: int = 100) -> dict[int, dict[str, float]]:
    """Median ms of a T-row step through each of `runners` (name -> step_runner; None: eager), interleaved."""
    samples = {T: {name: [] for name in runners} for T in sizes}
    with torch.inference_mode():
        model.step_runner = None
        cache = model.new_cache(past + max(sizes) + 1)
        model(torch.randint(1000, (1, past)), torch.arange(past), cache)
        cache.commit(past)
        for rep in range(repeats + 1):
            for name, step_runner in runners.items():
                model.step_runner = step_runner
                for T in sizes:
                    positions, mask = interleaved_step(past, T, lanes=4)
                    start = time.perf_counter()
                    model(torch.randint(1000, (1, T)), positions, cache, mask)
                    if rep:
                        samples[T][name].append(time.perf_counter() - start)
    return {T: {k: round(statistics.median(v) * 1e3, 1) for k, v in s.items()} for T, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("weights", choices=["float32", "bfloat16", "int8", "int4", "w7a8"])
    p.add_argument("--ckpt", default=None, help="default: the demo model")
    args = p.parse_args(argv)
    dtype = "bfloat16" if args.weights == "bfloat16" else "float32"
    quantize = args.weights if args.weights in ("int8", "int4", "w7a8") else None
    llm = LLM.load(args.ckpt, dtype=dtype, quantize=quantize, progress=False, compile=False)
    start = time.perf_counter()
    model = compile_steps(llm.model)
    exact = check_invariance(model)
    result = {"weights": args.weights, "cpu_flags": cpu_flags(), "exact_compiled": exact,
              "check_and_compile_s": round(time.perf_counter() - start, 1)}
    runners = {"eager": None, "compiled": model.step_runner}
    if native_missing(model) is None:  # w7a8 layers in float32: native steps too
        model.step_runner = NativeSteps()
        result["exact_native"] = check_invariance(model)
        runners["native"] = model.step_runner
    result["ms"] = step_ms(model, runners)
    print(f"CPU flags: {result['cpu_flags']}")
    print(f"{args.weights}: compiled steps exact: {exact} (check and first compiles {result['check_and_compile_s']} s)"
          + (f"; native steps exact: {result['exact_native']}" if "native" in runners else ""))
    print(f"| rows | {' | '.join(f'{name} ms' for name in runners)} |\n| --- |{' --- |' * len(runners)}")
    for T, ms in result["ms"].items():
        print(f"| {T} | {' | '.join(str(ms[name]) for name in runners)} |")
    bandwidth, weights = read_bandwidth(1024), step_weight_bytes(model)  # GB/s, bytes
    floor_ms = weights / (bandwidth * 1e9) * 1e3
    result.update(read_gb_s=round(bandwidth, 1), weight_mb=round(weights / 1e6, 1), floor_ms=round(floor_ms, 1),
                  one_row_vs_floor={k: round(v / floor_ms, 2) for k, v in result["ms"][1].items()})
    print(f"weights a step reads {result['weight_mb']} MB, read bandwidth {result['read_gb_s']} GB/s: floor "
          f"{floor_ms:.1f} ms a token; the one-row step is "
          + ", ".join(f"x{ratio} of it {name}" for name, ratio in result["one_row_vs_floor"].items()))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
