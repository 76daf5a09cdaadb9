"""What each extra row of a decoding step costs, and where it goes: the step against its parts, side by side.

Lookahead and `auto` pay off only where a step of many rows costs little more than a step of one (a row a fed
draft token). This job takes the batch-invariant step minilade decodes with, on a model of --preset's shape with
random weights, after --context committed tokens, at each of --rows (lookahead-shaped: masks.interleaved_step),
and times in the same interleaved rounds:
- the step: the whole forward pass, every row's logits;
- its weight matmuls alone: every linear layer of the model (the output head included) on a (rows, in)
  activation, back to back, under the row tiling the step uses;
- its attention alone: `invariant_attention` once per layer on the step's own key layout and cache;
- the rest: the step less the two (norms, rotary, the cache write, the layout, Python).
Each figure is a median over --rounds rounds (after one of warm-up); ratios are to a one-row step. The extra rows'
rate is 2 x parameters x (rows - 1) flops over the time the matmuls took above one row: where it sits at the
machine's arithmetic peak, the kernel did the extra rows' arithmetic after reading the weights rather than while
reading them, and every row a step feeds costs that much.

    python -m scripts.bench.row_cost --preset smollm2-135m --context 300 --rows 1 2 4 8 16 32
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from minilade.device import make_exact
from minilade.invariance import ExactAttention, RowTiledLinear, invariant_attention, padded_views
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
from .plots import import_figure

MODULE = "scripts.bench.row_cost"
PARTS = ("step", "matmuls", "attention")


def weight_matmuls(model: Transformer, rows: int) -> tuple[Callable[[], None], int]:
    """(a call that runs every linear layer of the model on a (rows, in) activation, their parameter count)."""
    layers = [m for m in model.modules() if isinstance(m, (RowTiledLinear, nn.Linear))]
    inputs = [torch.randn(rows, layer.weight.shape[1], dtype=model.dtype) for layer in layers]

    def run() -> None:
        for layer, x in zip(layers, inputs):
            layer(x)

    return run, sum(layer.weight.numel() for layer in layers)


def step_parts(model: Transformer, context: int, rows: int) -> dict[str, Callable[[], None]]:
    """The step of `rows` rows after `context` committed tokens, and its parts, as calls (the step's keys are
    written to the cache once, uncommitted, so attention alone reads what the step reads)."""
    cache = model.new_cache(context + rows)
    model(torch.randint(model.config.vocab_size, (1, context)), torch.arange(context), cache)
    cache.commit(context)
    positions, mask = interleaved_step(context, rows, lanes=4)
    tokens = torch.randint(model.config.vocab_size, (1, rows))
    model(tokens, positions, cache, mask)
    if not isinstance(model.attention_kernel, ExactAttention):
        raise RuntimeError("the model does not take the batch-invariant attention path")
    layout = model.attention_kernel.prepare(*model.step_masks(mask, context, rows, positions), context, model.dtype)
    c = model.config
    q = torch.randn(1, c.n_heads, rows, c.head_dim, dtype=model.dtype)

    def attention() -> None:
        for layer in range(c.n_layers):
            invariant_attention(q, *padded_views(cache, layer, layout.keys), layout)

    return {"step": lambda: model(tokens, positions, cache, mask), "matmuls": weight_matmuls(model, rows)[0],
            "attention": attention}


def extra_rows_gflops(parameters: int, rows: int, seconds: float, one_row_seconds: float) -> float | None:
    """The rate, in GFLOPS, at which the multiply-adds of rows - 1 extra rows were done: their flops over the time
    above a one-row pass (None for one row, or when the pass was not slower)."""
    extra = seconds - one_row_seconds
    return 2 * parameters * (rows - 1) / extra / 1e9 if rows > 1 and extra > 0 else None


def measure(model: Transformer, context: int, rows: Sequence[int], rounds: int, show_progress: bool) -> list[dict]:
    """Median seconds of the step and of each part at every row count, all of them timed in each round."""
    calls = {(T, part): run for T in rows for part, run in step_parts(model, context, T).items()}
    samples: dict[tuple[int, str], list[float]] = {key: [] for key in calls}
    bar = progress(rounds + 1, "rounds", show_progress)
    for round_ in range(rounds + 1):
        for key, run in calls.items():
            start = time.perf_counter()
            run()
            if round_:  # the first round is warm-up
                samples[key].append(time.perf_counter() - start)
        bar.update()
    bar.close()
    parameters = weight_matmuls(model, 1)[1]
    results = []
    for T in rows:
        median = {part: statistics.median(samples[(T, part)]) for part in PARTS}
        results.append({"rows": T, **median, "rest": median["step"] - median["matmuls"] - median["attention"]})
    one = results[0]
    for r in results:
        r["extra_rows_gflops"] = extra_rows_gflops(parameters, r["rows"], r["matmuls"], one["matmuls"])
    return results


def table_row(r: dict, one: dict) -> str:
    rate = r["extra_rows_gflops"]
    cells = [f"{1e3 * r[part]:.1f} ({r[part] / one[part]:.2f})" for part in PARTS]
    return (f"| {r['rows']} | {cells[0]} | {cells[1]} | {'' if rate is None else f'{rate:.0f}'} | {cells[2]} | "
            f"{1e3 * r['rest']:.1f} |")


def plot(results: list[dict], title: str, path: Path) -> None:
    """Each part's milliseconds above a one-row step, stacked, against the rows of the step."""
    figure = import_figure()(figsize=(6, 4))
    ax = figure.subplots()
    rows = [r["rows"] for r in results]
    one = results[0]
    extra = {part: [1e3 * (r[part] - one[part]) for r in results] for part in ("matmuls", "attention", "rest")}
    ax.stackplot(rows, *extra.values(), labels=["weight matmuls", "attention", "the rest"], alpha=0.8)
    ax.plot(rows, [1e3 * (r["step"] - one["step"]) for r in results], "k.-", label="whole step")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows, [str(T) for T in rows])
    ax.set_xlabel("rows in the step")
    ax.set_ylabel("ms above a one-row step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    write_png(path, figure)


def job(argv: list[str]) -> int:
    p = JobParser(MODULE, __doc__)
    p.add_argument("--dtype", choices=CPU_DTYPES, default="float32")
    p.add_argument("--context", type=positive_int, default=300)
    p.add_argument("--rows", nargs="+", type=positive_int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--rounds", type=positive_int, default=11)
    add_random_model_options(p, DEFAULT_OUT_DIR / "row_cost")
    args = p.parse_args(argv)
    env = begin_timed_run(command_line(MODULE, argv), args.threads)
    torch.manual_seed(args.seed)
    config = preset_fitting(args.preset, args.context + max(args.rows))
    model = Transformer(config).init_random(seed=args.seed)
    model = model.to(getattr(torch, args.dtype)).eval()
    exact = make_exact(model, warn=False).exact
    rows = sorted(set(args.rows) | {1})
    with torch.inference_mode():
        results = measure(model, args.context, rows, args.rounds, not args.no_progress)
    title = f"{args.preset}, {args.dtype}, after {args.context} tokens"
    print(f"\n{title}, random weights, exact steps: {exact}; ms (x a one-row step), median of {args.rounds} "
          f"rounds\n")
    print("| rows | step | weight matmuls | extra rows done at, GFLOPS | attention | the rest, ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(table_row(r, results[0]))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "row_cost.json", {"environment": env, "preset": args.preset, "dtype": args.dtype,
                                               "context": args.context, "exact": exact, "results": results},
               indent=1)
    plot(results, title, args.out_dir / "row_cost.png")
    print(f"\nwrote {args.out_dir / 'row_cost.json'} and row_cost.png")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())
