"""Where a shared pass's time goes: N requests through the server's engine in this process, every pass logged.

Each round starts N requests together through `serve.Engine` (a closed batch: nobody sends another when one
finishes), once per strategy, the strategies in turn (their order rotating by round) so that slow and fast spells
of a shared machine fall on each alike. Every pass the engine runs is logged (its calls, its rows, its seconds) by
wrapping the engine's `batched_forward`. Reported per strategy, medians over the rounds:
- tokens/s: all requests' new tokens over the round's wall time;
- passes, and call-steps (the sum over passes of the calls in them: each request's own step count);
- tokens per call-step (what drafts buy a request) against the passes' mean cost;
- tail: the passes with fewer calls than requests (some finished first) and their share of the round's time.
A strategy that needs fewer call-steps than another need not need fewer passes: in a closed batch the request
with the most steps sets the number of passes, and the passes after the first request finishes carry fewer calls.
Every answer is compared with the first strategy's (greedy: they must be identical).

Torch work is done where the server does it: the model is loaded, and each round's engine made (its pass checks),
in threads that end before the passes run, so that the engine's thread holds the process's only OpenMP pool (a
second live pool, the main thread's, made a pass of four one-row calls 29 ms instead of 11: serve/engine.py).

With --shapes-keys K, first the cost of a pass by the shape of its calls: passes of one-row calls (stacked, as
plain decoding's), of one call of several rows, and of one-row calls beside a call of several rows (which attends
alone, as a call with drafts does), each call's cache holding about K keys, shapes interleaved, medians.

    python -m scripts.bench.serve_trace --data ../shared/data --set mt_bench --requests 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch

from minilade import LLM
from minilade.checkpoints.resolve import kept_tables_dir
from minilade.decoding import GenerationSettings, make_strategy
from minilade.decoding.auto import COST_SIZES
from minilade.decoding.step_costs import step_costs_for
from minilade.serve import engine as engine_module
from minilade.serve.batched import ForwardCall, batched_forward, prepare_call
from minilade.serve.engine import Engine, Job

from .common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    UsageError,
    command_line,
    describe_machine,
    environment,
    fmt,
    progress,
    run_job,
    write_json,
)
from .serve import SETS, set_prompts

T = TypeVar("T")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.serve_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="folder of the prompt sets (shared/data)")
    p.add_argument("--set", choices=list(SETS), default="mt_bench")
    p.add_argument("--first", type=int, default=0, help="index of the first prompt of the set")
    p.add_argument("--requests", type=int, default=4, help="requests started together in each round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--strategies", nargs="+", default=["autoregressive", "auto"])
    p.add_argument("--ckpt", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--quantize", choices=["auto", "int4", "w7a8"], default="auto", help="as the server's")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--shapes-keys", type=int, default=0,
                   help="first time passes of fixed shapes over caches of this many keys (0: skip)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        raise UsageError("--requests, --rounds and --max-tokens must be at least 1")
    if args.shapes_keys < 0:
        raise UsageError("--shapes-keys must be 0 (skip) or more")
    return args


class PassLog:
    """The engine's passes, as (calls, rows, seconds), recorded by a wrapper around its batched_forward."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, int, float]] = []
        self._forward = engine_module.batched_forward

    def __enter__(self) -> PassLog:
        def logged(model, calls, *rest):
            start = time.perf_counter()
            out = self._forward(model, calls, *rest)
            self.passes.append((len(calls), sum(p.T for p in calls), time.perf_counter() - start))
            return out

        engine_module.batched_forward = logged
        return self

    def __exit__(self, *exc) -> None:
        engine_module.batched_forward = self._forward


def one_round(llm: LLM, prompts: list[list[int]], strategy: str, costs, max_tokens: int) -> dict:
    """The prompts as requests started together; their answers and the passes that made them."""
    answers: list[list[int] | None] = [None] * len(prompts)
    lock = threading.Lock()
    finished, all_done = [0], threading.Event()  # deliver runs in the workers: it must not block them

    def deliver_to(i: int):
        def deliver(kind: str, value) -> None:
            if kind == "done":
                answers[i] = value.token_ids
            if kind != "piece":
                with lock:
                    finished[0] += 1
                    if finished[0] == len(prompts):
                        all_done.set()
        return deliver

    engine = in_own_thread(lambda: Engine(llm, max_concurrent=len(prompts), queue_size=len(prompts)))
    engine.start()
    with PassLog() as log:
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            settings = GenerationSettings(make_strategy(strategy, costs=costs), max_new_tokens=max_tokens)
            engine.submit(Job(ids, settings, deliver_to(i)))
        all_done.wait()
        seconds = time.perf_counter() - start
    engine.stop()
    if any(a is None for a in answers):
        raise RuntimeError(f"a request of strategy {strategy} failed")
    return {"seconds": seconds, "answers": answers, "passes": log.passes}


def in_own_thread(make: Callable[[], T]) -> T:
    """make() run in a thread that ends with it, so that the OpenMP pool its torch work opens goes with it and the
    calling thread opens none (module docstring)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(make())
        except BaseException as error:  # noqa: BLE001 -- raised again in the calling thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def summary(run: dict, requests: int) -> dict:
    passes, tokens = run["passes"], sum(len(a) for a in run["answers"])
    call_steps = sum(calls for calls, _, _ in passes)
    tail = [p for p in passes if p[0] < requests]
    return {"tokens_per_s": tokens / run["seconds"], "passes": len(passes), "call_steps": call_steps,
            "tokens_per_call_step": tokens / call_steps, "rows_per_pass": sum(r for _, r, _ in passes) / len(passes),
            "ms_per_pass": 1e3 * sum(s for _, _, s in passes) / len(passes),
            "ms_per_full_pass": 1e3 * statistics.median([s for c, _, s in passes if c == requests] or [0.0]),
            "tail_passes": len(tail), "tail_time_share": sum(s for _, _, s in tail) / run["seconds"],
            "pass_time_share": sum(s for _, _, s in passes) / run["seconds"]}


COLUMNS = [("tokens_per_s", "tok/s", ".1f"), ("passes", "passes", ".0f"), ("call_steps", "call-steps", ".0f"),
           ("tokens_per_call_step", "tok/call-step", ".2f"), ("rows_per_pass", "rows/pass", ".1f"),
           ("ms_per_pass", "ms/pass", ".1f"), ("ms_per_full_pass", "ms/full pass", ".1f"),
           ("tail_passes", "tail passes", ".0f"), ("tail_time_share", "tail time", ".0%"),
           ("pass_time_share", "time in passes", ".0%")]


SHAPES = {"1 call x 1 row": [1], "1 call x 4 rows": [4], "4 calls x 1 row": [1] * 4,
          "3 calls x 1 row + 1 x 4 rows": [1, 1, 1, 4], "8 calls x 1 row": [1] * 8}


def pass_shapes(llm: LLM, keys: int, rounds: int = 7) -> dict[str, float]:
    """Median ms of a pass of each SHAPES entry (rows per call; causal calls, call i over a cache of keys + 7i
    committed keys), the shapes interleaved round by round."""
    model = llm.model
    caches = []
    with torch.inference_mode():
        for i in range(max(map(len, SHAPES.values()))):
            cache, past = model.new_cache(keys + 7 * i + 64), keys + 7 * i
            model(torch.randint(0, model.config.vocab_size, (1, past)), torch.arange(past), cache)
            cache.commit(past)
            caches.append(cache)

    def run(rows: list[int]) -> None:
        calls = [ForwardCall(torch.randint(0, model.config.vocab_size, (1, T)),
                             torch.arange(caches[i].length, caches[i].length + T), caches[i])
                 for i, T in enumerate(rows)]
        with torch.inference_mode():
            batched_forward(model, [prepare_call(model, call) for call in calls])

    times: dict[str, list[float]] = {name: [] for name in SHAPES}
    for r in range(rounds + 1):  # round 0 warms up
        for name, rows in SHAPES.items():
            start = time.perf_counter()
            run(rows)
            if r:
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main_job(argv: list[str]) -> int:
    args = parse_args(argv)
    every, chat = set_prompts(args.data, args.set)
    texts = every[args.first:args.first + args.requests]
    if len(texts) < args.requests:
        raise UsageError(f"the {args.set} set has {len(every)} prompts; --first {args.first} --requests "
                         f"{args.requests} needs {args.first + args.requests}")
    env = environment()
    print(f"command: {command_line('scripts.bench.serve_trace', argv)}")
    print(describe_machine(env))
    llm = in_own_thread(lambda: LLM.load(args.ckpt, progress=False, quantize=args.quantize))
    print(f"setup: {llm.setup}")
    costs = in_own_thread(lambda: step_costs_for(llm.model, COST_SIZES, kept_tables_dir() / "step_costs.json"))
    prompts = [llm.encode(t, chat=chat) for t in texts]
    shapes = in_own_thread(lambda: pass_shapes(llm, args.shapes_keys)) if args.shapes_keys else None
    if shapes:
        print(f"\npasses by shape, caches of about {args.shapes_keys} keys (median ms):")
        for name, ms in shapes.items():
            print(f"  {name:30s} {ms:7.1f}")
    one_round(llm, [prompts[0]], args.strategies[0], costs, 8)  # warm-up (first passes, allocations)
    runs: dict[str, list[dict]] = {s: [] for s in args.strategies}
    with progress(args.rounds * len(args.strategies), "rounds", not args.no_progress) as bar:
        for r in range(args.rounds):
            order = args.strategies[r % len(args.strategies):] + args.strategies[:r % len(args.strategies)]
            for strategy in order:
                runs[strategy].append(one_round(llm, prompts, strategy, costs, args.max_tokens))
                bar.update()
    reference = runs[args.strategies[0]][0]["answers"]
    results = {}
    for strategy, rounds in runs.items():
        rows = [summary(run, args.requests) for run in rounds]
        results[strategy] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        results[strategy]["identical"] = sum(a == b for run in rounds for a, b in zip(run["answers"], reference))
        results[strategy]["answers"] = args.requests * args.rounds
    print(f"\n{args.requests} requests started together, {args.max_tokens} new tokens, greedy; medians of "
          f"{args.rounds} rounds")
    print("| strategy | " + " | ".join(title for _, title, _ in COLUMNS) + " | identical |")
    print("| --- " * (len(COLUMNS) + 2) + "|")
    for strategy, row in results.items():
        cells = " | ".join(fmt(row[key], spec) for key, _, spec in COLUMNS)
        print(f"| {strategy} | {cells} | {row['identical']}/{row['answers']} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "serve_trace.json"
    write_json(out, {"command": command_line("scripts.bench.serve_trace", argv), "environment": env,
                     "pass_shapes_ms": shapes, "results": results}, indent=1)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_job(main_job, argv)


if __name__ == "__main__":
    sys.exit(main())
