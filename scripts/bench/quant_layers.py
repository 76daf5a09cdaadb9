"""The layers part of the quantization bench (scripts/bench/quant.py --parts layers): per-layer matmul milliseconds
at 1..64 rows on SmolLM2-135M's shapes, every kernel on the same random weight, interleaved."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minilade.integer_linear import W7A8Linear
from minilade.quant import Int4Weight, QuantizedLinear, quantize_weight

LAYER_ROWS = (1, 2, 4, 8, 16, 32, 64)
LAYER_SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536),
                "output": (49152, 576)}  # SmolLM2-135M, (out, in)


def on_the_fly(weight: Int4Weight) -> Callable[[torch.Tensor], torch.Tensor]:
    """A dense float32 matmul on the weight dequantized from its codes at every call (codes kept one a byte)."""
    N, K = weight.codes.shape
    scales, zeros = weight.scales[..., None], weight.zeros[..., None]

    def run(x: torch.Tensor) -> torch.Tensor:
        dense = (weight.codes.view(N, -1, weight.group_size).float() - 8).mul_(scales).add_(zeros)
        return F.linear(x, dense.view(N, K))

    return run


def layer_kernels(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every way of computing x @ weight.T that the layers part compares; x is float32."""
    dense_bf16 = weight.bfloat16()
    return {
        "float32": lambda x: F.linear(x, weight),
        "bfloat16": lambda x: F.linear(x.bfloat16(), dense_bf16),
        "int8": QuantizedLinear(quantize_weight(weight, "int8", 32)),
        "int4 g32": QuantizedLinear(quantize_weight(weight, "int4", 32)),
        "int4 g64": QuantizedLinear(quantize_weight(weight, "int4", 64)),
        "int4 on the fly": on_the_fly(quantize_weight(weight, "int4", 32)),
        "w7a8": W7A8Linear(weight),
    }


def run_layers(args: argparse.Namespace) -> dict:
    """Milliseconds per call, median of interleaved repeats; the kernels' order is shuffled every time."""
    rng = random.Random(args.seed)
    cases = []
    for layer, (N, K) in LAYER_SHAPES.items():
        kernels = layer_kernels(torch.randn(N, K) * 0.02)
        for rows in LAYER_ROWS:
            x = torch.randn(rows, K)
            cases.append((layer, rows, x, kernels))
    samples: dict[tuple[str, int, str], list[float]] = {}
    for rep in range(args.layer_repeats + 1):
        for layer, rows, x, kernels in cases:
            for name in rng.sample(list(kernels), len(kernels)):
                start = time.perf_counter()
                kernels[name](x)
                if rep:  # the first round warms up
                    samples.setdefault((layer, rows, name), []).append(time.perf_counter() - start)
    table = {f"{layer} {rows}": {name: 1e3 * statistics.median(samples[(layer, rows, name)]) for name in kernels}
             for layer, rows, _, kernels in cases}
    print_table("ms per call (weights stay in cache between calls: one-row figures flatter dense float32)", table)
    return table


def print_table(title: str, table: dict[str, dict[str, Any]], spec: str = ".3f") -> None:
    columns = list(next(iter(table.values())))
    print(title)
    print(f"{'':18s}" + "".join(f"{c:>17s}" for c in columns))
    for row, cells in table.items():
        print(f"{row:18s}" + "".join(f"{format(cells[c], spec) if isinstance(cells[c], float) else cells[c]:>17}"
                                      for c in columns))
