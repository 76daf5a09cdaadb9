"""Tensor parallelism on this CPU: the cost of one forward pass on 1, 2 and 3 ranks, and what the collectives
alone cost per step.

    python -m scripts.bench.tensor_parallel                      # ranks 1 2 3, steps of 1 8 32 tokens
    python -m scripts.bench.tensor_parallel --ranks 1 2 --sizes 1 16 --repeats 9

Each rank count runs as that many processes (gloo, one torch thread each, started here with torchrun's
environment) over a model with random weights of the --shape (by default SmolLM2-135M's layers, vocabulary and
widths with 12 query and 6 key/value heads, so that it splits over 2 and over 3 ranks). Per step size T, after
--context committed tokens: the median seconds of a forward pass of T tokens with every row projected to the
vocabulary (decoding/step_costs.measure_step_costs, warm-up first), and, timed on their own, the step's
collectives: 2 sums over ranks per layer of a (T, dim) tensor, in rank order as the model does them
(ordered_sum: an all-gather), next to gloo's all_reduce of the same tensors (not used by the model: its order
depends on the size), and the gather of the (T, V) logits. 1 rank is the plain single-process model.
Prints the CPU flags and a table; writes tensor_parallel.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from minilade.config import ModelConfig
from minilade.decoding.step_costs import measure_step_costs
from minilade.model import Transformer
from minilade.parallel import init_tensor_parallel
from minilade.parallel.group import gather_last_dim, ordered_sum
from minilade.parallel.layers import wrap_rank_model
from minilade.parallel.plan import ShardPlan

from .common import DEFAULT_OUT_DIR, JobParser, begin_timed_run, command_line, fmt, positive_int, run_job, write_json

MODULE = "scripts.bench.tensor_parallel"
SHAPE = ModelConfig.preset("smollm2-135m").replace(n_heads=12, n_kv_heads=6, head_dim=48, max_seq_len=1024)


def parse_args(argv: Sequence[str]):
    p = JobParser(MODULE, __doc__)
    p.add_argument("--ranks", type=positive_int, nargs="+", default=[1, 2, 3])
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[1, 8, 32], help="tokens fed per step")
    p.add_argument("--context", type=positive_int, default=128, help="committed tokens before each timed step")
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--layers", type=positive_int, default=SHAPE.n_layers, help="layers of the random model")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)  # run as one rank, rank 0 writing OUT
    return p.parse_args(argv)


# ---- one rank --------------------------------------------------------------------------------------------------

def rank_model(config: ModelConfig) -> Transformer:
    """This rank's part of a random model (the plain model on one rank); random weights time like real ones."""
    if not dist.is_initialized():
        return Transformer(config).init_random(seed=0).eval().requires_grad_(False)
    plan = ShardPlan(config, dist.get_rank(), dist.get_world_size(), config.vocab_size)
    model = Transformer(plan.rank_config).init_random(seed=dist.get_rank()).eval().requires_grad_(False)
    head = model.output.weight[:plan.ranges()["vocab"][1] - plan.ranges()["vocab"][0]]
    return wrap_rank_model(model, head, plan.vocab_chunk, plan.vocab, plan.rank, dist.group.WORLD)


def collective_seconds(config: ModelConfig, T: int, repeats: int) -> dict[str, float]:
    """Median seconds of one step's collectives alone: 2 sums per layer of (1, T, dim) and the logits' gather."""
    x = torch.randn(1, T, config.dim)
    logits = torch.randn(1, T, -(-config.vocab_size // dist.get_world_size()))

    def timed(run) -> float:
        samples = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])

    sums = 2 * config.n_layers
    group = dist.group.WORLD
    return {"ordered_sums_s": timed(lambda: [ordered_sum(x, group) for _ in range(sums)]),
            "all_reduces_s": timed(lambda: [dist.all_reduce(x.clone()) for _ in range(sums)]),
            "logits_gather_s": timed(lambda: gather_last_dim(logits, group))}


def worker(config: ModelConfig, out: str, args) -> None:
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_tensor_parallel(torch.device("cpu"))
    model = rank_model(config)
    steps = measure_step_costs(model, args.sizes, context=args.context, repeats=args.repeats)
    record = {T: {"step_s": s} for T, s in steps.items()}
    if dist.is_initialized():
        for T in args.sizes:
            record[T].update(collective_seconds(config, T, args.repeats))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, steps)
        for T in args.sizes:
            record[T]["slowest_rank_step_s"] = max(s[T] for s in every)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(record))
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------------------------

def launch(ranks: int, argv: Sequence[str], out: Path) -> dict:
    """Run `ranks` worker processes (one thread each) and return rank 0's record."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", MODULE, *argv, "--worker", str(out)],
                                      env=env))
    if any(p.wait() for p in procs):
        raise SystemExit(f"a worker of the {ranks}-rank run failed")
    return {int(T): v for T, v in json.loads(out.read_text()).items()}


def table(results: dict[int, dict[int, dict]], sizes: Sequence[int]) -> str:
    lines = ["T    ranks  step ms  vs 1 rank  sums ms (ordered / all_reduce)  logits gather ms  comm share"]
    for T in sizes:
        base = results.get(1, {}).get(T, {}).get("step_s")
        for ranks, record in sorted(results.items()):
            r = record[T]
            comm = r.get("ordered_sums_s", 0.0) + r.get("logits_gather_s", 0.0)
            speed = f"{base / r['step_s']:.2f}x" if base else "-"
            sums = f"{fmt(1e3 * r['ordered_sums_s'], '.2f')} / {fmt(1e3 * r['all_reduces_s'], '.2f')}" \
                if "ordered_sums_s" in r else "-"
            gather = fmt(1e3 * r["logits_gather_s"], ".2f") if "logits_gather_s" in r else "-"
            lines.append(f"{T:<4} {ranks:<6} {1e3 * r['step_s']:<8.1f} {speed:<10} {sums:<31} {gather:<17} "
                         f"{comm / r['step_s']:.0%}")
    return "\n".join(lines)


def job(argv: list[str]) -> int:
    args = parse_args(argv)
    config = SHAPE.replace(n_layers=args.layers)
    if args.worker:
        worker(config, args.worker, args)
        return 0
    command = command_line(MODULE, argv)
    env = begin_timed_run(command, 1)
    print(f"model: random weights, {config.n_layers} layers, dim {config.dim}, {config.n_heads}/{config.n_kv_heads} "
          f"heads, MLP {config.intermediate_size}, vocab {config.vocab_size}; context {args.context}; one torch "
          f"thread per rank on {os.cpu_count()} cores", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            results[ranks] = launch(ranks, argv, Path(tmp) / f"{ranks}.json")
    print(table(results, args.sizes))
    write_json(args.out_dir / "tensor_parallel.json", {"command": command, "environment": env,
                                                       "model": {k: v for k, v in config.__dict__.items()
                                                                 if k != "rope_scaling"},
                                                       "context": args.context, "repeats": args.repeats,
                                                       "results": results})
    print(f"\nwrote {args.out_dir / 'tensor_parallel.json'}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())
