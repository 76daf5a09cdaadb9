"""The floor under one autoregressive decode step: the model's weight matmuls alone, for one token.

Every 2-D weight of the model (the tied embedding once, as the output head) multiplies a (1, in) activation, in
each --dtypes, back to back with nothing else in between. Any implementation that calls torch's matmul kernels
pays at least this per token; the rest of a real step (attention, norms, rotary, Python) comes on top. Compare
with `python -m scripts.bench.ar`.

    python -m scripts.bench.matmul_floor --dtypes float32 bfloat16
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from minilade import LLM
from minilade.checkpoints import DEFAULT_CHECKPOINT

from .common import (
    CPU_DTYPES,
    JobParser,
    describe_machine,
    environment,
    median_seconds,
    positive_int,
    run_job,
)

MODULE = "scripts.bench.matmul_floor"


def one_token_pass(weights: list[torch.Tensor]) -> Callable[[], None]:
    """A call that multiplies a (1, in) activation by every weight, back to back (inputs made beforehand)."""
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}

    def run() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return run


def floor_row(dtype: str, weights: list[torch.Tensor], seconds: float) -> str:
    """A table row: weight MB, ms per token, the tokens/s ceiling and the weight bytes read per second."""
    size = sum(w.numel() * w.element_size() for w in weights)
    return f"| {dtype} | {size / 1e6:.0f} | {1e3 * seconds:.1f} | {1 / seconds:.1f} | {size / seconds / 1e9:.1f} |"


def job(argv: list[str]) -> int:
    p = JobParser(MODULE, __doc__)
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT)
    p.add_argument("--dtypes", nargs="+", choices=CPU_DTYPES, default=list(CPU_DTYPES))
    p.add_argument("--reps", type=positive_int, default=30)
    args = p.parse_args(argv)
    llm = LLM.load(args.ckpt, dtype="float32", device="cpu", progress=False, exact=False, compile=False)
    matrices = [w for w in llm.model.parameters() if w.dim() == 2]
    print(describe_machine(environment()))
    print(f"{len(matrices)} weight matrices, {sum(w.numel() for w in matrices) / 1e6:.1f} M parameters, "
          f"{torch.get_num_threads()} threads\n")
    print("| dtype | weight MB | matmuls only, ms/token | tokens/s ceiling | weight GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for dtype in args.dtypes:
        weights = [w.detach().to(getattr(torch, dtype)).contiguous() for w in matrices]
        print(floor_row(dtype, weights, median_seconds(one_token_pass(weights), args.reps)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())
