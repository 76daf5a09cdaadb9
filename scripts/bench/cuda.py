"""What minilade's decoding steps do on a CUDA GPU, with random weights (no checkpoint reaches such a machine).

- exactness: whether a step's rows are batch-invariant there (device.check_invariance: a token's logits from a
  one-row step equal its row in a wide step, bitwise), with the stock kernels (SDPA, cuBLAS) and with the exact
  backend (device.make_exact: invariance.py's attention, weight matmuls in a row tiling found on that GPU); and
  whether greedy lookahead and `auto` then give plain decoding's tokens, counted over random prompts. Models: the
  shapes of --preset cut to --check-layers layers (a step's kernels depend on its shapes, not on its depth), and a
  tiny one whose repetitive output lets lookahead accept drafts.
- cost: a step of T rows after --context tokens on a model of --preset's shape, stock and exact, the medians of
  --rounds interleaved rounds, against the weight-read floor (weight bytes over the device-to-device copy bandwidth
  measured on that GPU).

    python -m scripts.bench.cuda --out bench_out/cuda.json
"""

from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

import torch

from minilade.config import ModelConfig
from minilade.decoding import (
    Auto,
    Autoregressive,
    GenerationSettings,
    GenerationStats,
    Lookahead,
    TokenRun,
    decode_tokens,
)
from minilade.decoding.step_costs import StepCosts, measure_step_costs
from minilade.device import check_invariance, make_exact
from minilade.model import Transformer

from .common import DEFAULT_OUT_DIR, environment, write_json

STEP_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 std: float = 0.02) -> Transformer:
    """A model of config's shape with normal random weights made on the device (a 7B model in seconds)."""
    with torch.device(device):
        model = Transformer(config).to(dtype).eval()
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1 if name.endswith("norm.weight") else std,
                      generator=gen)
    model.setup_rope()
    return model


def made_exact(model: Transformer) -> dict:
    """device.make_exact on the model; what it found."""
    found = make_exact(model, warn=False)
    return {"invariant": found.exact, "tilings": {shape: str(t) for shape, t in found.tilings.items()}}


def greedy_agreement(model: Transformer, prompts: int, new_tokens: int, seed: int = 0) -> dict:
    """How many random prompts give plain decoding's tokens under lookahead and auto (greedy), and their steps."""
    gen = torch.Generator().manual_seed(seed)
    costs = StepCosts(measure_step_costs(model, (1, 8, 32, 64), context=64, repeats=2))
    strategies = {"lookahead": Lookahead(), "auto": Auto(costs=costs)}
    same = {name: 0 for name in strategies}
    steps = {name: 0 for name in ("plain", *strategies)}
    for _ in range(prompts):
        prompt = torch.randint(model.config.vocab_size, (int(torch.randint(8, 40, (1,), generator=gen)),),
                               generator=gen).tolist()
        expected, steps_taken = run(model, prompt, Autoregressive(), new_tokens)
        steps["plain"] += steps_taken
        for name, strategy in strategies.items():
            got, steps_taken = run(model, prompt, strategy, new_tokens)
            same[name] += got == expected
            steps[name] += steps_taken
    return {"prompts": prompts, "new_tokens": new_tokens, "identical": same, "forward_passes": steps}


def run(model: Transformer, prompt: list[int], strategy, new_tokens: int) -> tuple[list[int], int]:
    stats = GenerationStats()
    settings = GenerationSettings(strategy, max_new_tokens=new_tokens)
    tokens = list(decode_tokens(model, prompt, TokenRun(stats), settings))
    return tokens, stats.steps


def exactness(config: ModelConfig, dtype: torch.dtype, device: torch.device, prompts: int, new_tokens: int) -> dict:
    record: dict = {}
    for backend in ("stock", "exact"):
        model = random_model(config, dtype, device, std=0.3 if config.vocab_size < 1000 else 0.02)
        entry = made_exact(model) if backend == "exact" else {"invariant": check_invariance(model)}
        entry.update(greedy_agreement(model, prompts, new_tokens))
        record[backend] = entry
        print(f"  {backend}: {entry}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


def copy_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Bytes read and written per second by a device-to-device copy, median of 10 (the weight-read floor's rate)."""
    n = int(gib * 2 ** 30) // 2
    a, b = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    samples = []
    for rep in range(11):
        sync(device)
        start = time.perf_counter()
        b.copy_(a)
        sync(device)
        if rep:
            samples.append(2 * a.numel() * a.element_size() / (time.perf_counter() - start))
    return sorted(samples)[len(samples) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_costs(config: ModelConfig, dtype: torch.dtype, device: torch.device, context: int, rounds: int) -> dict:
    """Milliseconds of a step of each of STEP_ROWS rows, stock and exact, and the weight-read floor."""
    model = random_model(config, dtype, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, 4.0 if device.type == "cuda" else 0.25)
    record = {"weight_bytes": weight_bytes, "copy_bandwidth_bytes_per_s": bandwidth,
              "floor_ms": 1e3 * weight_bytes / bandwidth}
    for backend in ("stock", "exact"):
        if backend == "exact":
            record["exact_check"] = made_exact(model)
        seconds = measure_step_costs(model, STEP_ROWS, context=context, repeats=rounds)
        record[backend] = {str(T): 1e3 * s for T, s in seconds.items()}
        print(f"  {backend} ms: {record[backend]}", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--check-layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parts", nargs="+", default=["exactness", "cost"], choices=["exactness", "cost"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "cuda.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    config = ModelConfig.preset(args.preset)
    document = {"environment": environment(), "options": vars(args),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    print(document["gpu"], flush=True)
    if "exactness" in args.parts:
        models = {f"{args.preset} x{args.check_layers} layers": config.replace(n_layers=args.check_layers),
                  "tiny-gqa": ModelConfig.preset("tiny-gqa").replace(vocab_size=16)}
        for name, shape in models.items():
            for dtype in (torch.float32, torch.bfloat16):
                label = f"{name} {str(dtype).removeprefix('torch.')}"
                print(label, flush=True)
                try:
                    document.setdefault("exactness", {})[label] = exactness(shape, dtype, device, args.prompts,
                                                                            args.new_tokens)
                except Exception:  # a record of what failed on a machine we hold for minutes
                    document.setdefault("errors", {})[label] = traceback.format_exc()
                    print(traceback.format_exc(), flush=True)
                write_json(args.out, document, indent=1)
    if "cost" in args.parts:
        print(f"cost {args.preset} bfloat16", flush=True)
        try:
            document["cost"] = step_costs(config, torch.bfloat16, device, args.context, args.rounds)
        except Exception:
            document.setdefault("errors", {})["cost"] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
    write_json(args.out, document, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
