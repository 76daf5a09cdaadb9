"""The library's LLM.generate_many against generate() over the same prompts one after another: a set's tokens per
second at each concurrency, and every answer compared with the one its prompt gets alone.

    python -m scripts.bench.batch --datasets mt_bench humaneval --n-prompts 16 --concurrency 2 4 8

Each round runs, in a shuffled order, generate() over the set's prompts one after another and generate_many at every
concurrency, so that a slow spell of a shared machine falls on all of them alike; a figure is the median over rounds
of the set's new tokens over its wall time, and a speedup the median of the same round's ratios. Prints a table per
set and writes batch.json (every round) and batch.png under --out-dir.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from minilade import LLM

from .common import (
    DEFAULT_OUT_DIR,
    JobParser,
    add_prompt_options,
    encode_prompts,
    load_prompt_texts,
    positive_int,
    progress,
    run_timed_job,
    write_json,
    write_png,
)
from .plots import import_figure

MODULE = "scripts.bench.batch"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = JobParser(MODULE, __doc__)
    add_prompt_options(p, n_prompts=16)
    p.add_argument("--concurrency", nargs="+", type=positive_int, default=[2, 4, 8],
                   help="generations at once in generate_many (default: 2 4 8)")
    p.add_argument("--strategy", default="auto", choices=["auto", "autoregressive", "lookahead"])
    p.add_argument("--rounds", type=positive_int, default=2, help="timed rounds, after one that warms up")
    p.add_argument("--seed", type=int, default=0, help="seeds the order within each round")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return p.parse_args(argv)


def timed(llm: LLM, prompts: list[list[int]], concurrency: int, options: dict) -> tuple[float, list[list[int]]]:
    """Seconds and answers of the prompts: generate() one after another (concurrency 1) or generate_many."""
    start = time.perf_counter()
    if concurrency == 1:
        answers = [llm.generate(p, **options).token_ids for p in prompts]
    else:
        answers = [g.token_ids for g in llm.generate_many(prompts, concurrency=concurrency, **options)]
    return time.perf_counter() - start, answers


def run_set(llm: LLM, name: str, prompts: list[list[int]], args: argparse.Namespace, bar: Any) -> dict:
    """Every round of one set: tokens/s of each contender, and whether its answers equal generate()'s."""
    options = dict(max_new_tokens=args.max_new_tokens, strategy=args.strategy)
    levels = [1] + sorted(set(args.concurrency) - {1})
    order = random.Random(args.seed)
    rounds, alone, identical = [], None, {c: 0 for c in levels}
    for r in range(args.rounds + 1):
        shuffled = order.sample(levels, len(levels))
        seconds, answers = {}, {}
        for c in shuffled:
            seconds[c], answers[c] = timed(llm, prompts, c, options)
            bar.update()
        alone = alone or answers[1]
        tokens = sum(len(a) for a in answers[1])
        if r:  # the first round warms up
            rounds.append({"order": shuffled, "tokens": tokens,
                           "tokens_per_s": {str(c): tokens / seconds[c] for c in levels}})
        for c in levels:
            identical[c] += sum(a == b for a, b in zip(answers[c], alone))
    rates = {c: statistics.median(rd["tokens_per_s"][str(c)] for rd in rounds) for c in levels}
    speedups = {c: statistics.median(rd["tokens_per_s"][str(c)] / rd["tokens_per_s"]["1"] for rd in rounds)
                for c in levels}
    return {"dataset": name, "prompts": len(prompts), "rounds": rounds, "tokens_per_s": rates,
            "speedup": speedups, "identical": identical, "answers": len(prompts) * (args.rounds + 1)}


def table(result: dict) -> str:
    lines = [f"\n{result['dataset']}: {result['prompts']} prompts; answers identical to generate() alone, of "
             f"{result['answers']} each",
             "| concurrency | tokens/s | vs one after another | identical |", "| --- | --- | --- | --- |"]
    for c, rate in result["tokens_per_s"].items():
        label = "1 (generate, one after another)" if c == 1 else str(c)
        lines.append(f"| {label} | {rate:.1f} | x{result['speedup'][c]:.2f} | {result['identical'][c]} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    Figure = import_figure()
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    levels: list[int] = []
    for result in results:  # concurrency keys are ints, or strings as read back from batch.json
        rates = {int(c): rate for c, rate in result["tokens_per_s"].items()}
        levels = sorted(rates)
        ax.plot(levels, [rates[c] for c in levels], marker="o", label=result["dataset"])
    ax.set_xlabel("generations at once (1: generate() one after another)")
    ax.set_ylabel("tokens/s, whole set")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.legend()
    ax.set_title("LLM.generate_many")
    write_png(path, fig)


def run(args: argparse.Namespace, command: str, env: dict) -> None:
    llm = LLM.load(args.ckpt, progress=not args.no_progress)
    print(f"setup: {llm.setup}", flush=True)
    prompts = encode_prompts(llm, load_prompt_texts(args.data_dir, args.datasets, args.n_prompts),
                             not args.no_progress)
    runs = len(prompts) * (args.rounds + 1) * (len(set(args.concurrency) - {1}) + 1)
    results = []
    with progress(runs, "sets x rounds x contenders", not args.no_progress) as bar:
        for name, items in prompts.items():
            results.append(run_set(llm, name, items, args, bar))
            print(table(results[-1]), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "batch.json", {"command": command, "environment": env, "setup": llm.setup,
                                             "strategy": args.strategy, "max_new_tokens": args.max_new_tokens,
                                             "results": results})
    plot(results, args.out_dir / "batch.png")


def main(argv: Sequence[str] | None = None) -> int:
    return run_timed_job(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
