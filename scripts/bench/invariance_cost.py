"""What exactness costs: a batch-invariant decoding step against the same step on stock kernels.

For each dtype, a model of --preset's shape with random weights is built twice: made batch-invariant (weight
matmuls in their measured row tilings, attention over each row's visible keys: the path minilade decodes on) and
left on stock kernels (F.linear and SDPA, whose rows depend on the step's shape). Each then runs lookahead-shaped
steps (masks.interleaved_step: interleaved chains, every row's logits) of --rows tokens after --contexts committed
tokens; the two models alternate in a seeded random order, --repeats times after a warm-up, and each keeps the
median. The table gives both medians and their ratio (exactness should cost at most 10% at every size).

    python -m scripts.bench.invariance_cost --dtypes float32 bfloat16 --contexts 128 512 --rows 1 4 16 32 64
"""

from __future__ import annotations

import copy
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from minilade.device import make_exact
from minilade.masks import interleaved_step
from minilade.model import Transformer

from .common import (
    CPU_DTYPES,
    DEFAULT_OUT_DIR,
    JobParser,
    add_random_model_options,
    begin_timed_run,
    command_line,
    positive_int,
    preset_fitting,
    progress,
    run_job,
    write_json,
    write_png,
)

MODULE = "scripts.bench.invariance_cost"


def step_seconds(model: Transformer, context: int, T: int, cache) -> float:
    """One lookahead-shaped step of T rows after `context` committed tokens (left uncommitted)."""
    positions, mask = interleaved_step(context, T, lanes=4)
    tokens = torch.randint(model.config.vocab_size, (1, T))
    start = time.perf_counter()
    model(tokens, positions, cache, mask)
    return time.perf_counter() - start


def measure(models: dict[str, Transformer], contexts: Sequence[int], rows: Sequence[int], repeats: int,
            seed: int, show_progress: bool) -> list[dict]:
    """Median seconds per (context, rows, model), the models interleaved in a seeded random order."""
    order = random.Random(seed)
    results = []
    bar = progress(len(contexts) * len(rows) * (repeats + 1), "steps", show_progress)
    with torch.inference_mode():
        for context in contexts:
            caches = {}
            for name, model in models.items():
                caches[name] = model.new_cache(context + max(rows))
                model(torch.randint(model.config.vocab_size, (1, context)), torch.arange(context), caches[name])
                caches[name].commit(context)
            for T in rows:
                samples = {name: [] for name in models}
                for rep in range(repeats + 1):
                    names = list(models)
                    order.shuffle(names)
                    for name in names:
                        seconds = step_seconds(models[name], context, T, caches[name])
                        if rep:  # the first round is warm-up
                            samples[name].append(seconds)
                    bar.update()
                results.append({"context": context, "rows": T,
                                **{name: statistics.median(s) for name, s in samples.items()}})
    bar.close()
    return results


def plot(table: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, ax = plt.subplots(figsize=(6, 4))
    for dtype, results in table.items():
        for context in sorted({r["context"] for r in results}):
            rows = [r for r in results if r["context"] == context]
            ax.plot([r["rows"] for r in rows], [r["invariant"] / r["stock"] for r in rows], marker="o",
                    label=f"{dtype}, context {context}")
    ax.axhline(1.10, color="grey", linestyle="--", linewidth=1, label="target 1.10")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows in the step")
    ax.set_ylabel("invariant / stock step time")
    ax.legend(fontsize=8)
    write_png(path, figure)


def job(argv: list[str]) -> int:
    p = JobParser(MODULE, __doc__)
    p.add_argument("--dtypes", nargs="+", choices=CPU_DTYPES, default=list(CPU_DTYPES))
    p.add_argument("--contexts", nargs="+", type=positive_int, default=[128, 512])
    p.add_argument("--rows", nargs="+", type=positive_int, default=[1, 4, 16, 32, 64])
    p.add_argument("--repeats", type=positive_int, default=5)
    add_random_model_options(p, DEFAULT_OUT_DIR / "invariance_cost")
    args = p.parse_args(argv)
    env = begin_timed_run(command_line(MODULE, argv), args.threads)
    config = preset_fitting(args.preset, max(args.contexts) + max(args.rows))
    table, verdicts = {}, {}
    for dtype in args.dtypes:
        stock = Transformer(config).init_random(seed=args.seed).to(getattr(torch, dtype)).eval()
        invariant = copy.deepcopy(stock)
        verdicts[dtype] = make_exact(invariant, warn=False).exact
        table[dtype] = measure({"invariant": invariant, "stock": stock}, args.contexts, args.rows, args.repeats,
                               args.seed, not args.no_progress)
    print(f"\n{args.preset} shapes, random weights; ms per lookahead-shaped step, every row's logits\n")
    print("| dtype | exact | context | rows | invariant ms | stock ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype, results in table.items():
        for r in results:
            print(f"| {dtype} | {verdicts[dtype]} | {r['context']} | {r['rows']} | {1e3 * r['invariant']:.1f} | "
                  f"{1e3 * r['stock']:.1f} | {r['invariant'] / r['stock']:.2f} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "invariance_cost.json", {"environment": env, "preset": args.preset,
                                                       "exact": verdicts, "results": table}, indent=1)
    plot(table, args.out_dir / "invariance_cost.png")
    print(f"\nwrote {args.out_dir / 'invariance_cost.json'} and invariance_cost.png")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())
