"""Does torch.compile pay on the one-token step? Each layer's two regions around attention, compiled, against eager.

A decoding layer is (1) RMSNorm, the fused QKV projection and rotary embeddings, (2) attention over the cache,
(3) the output projection, residual, RMSNorm, SwiGLU MLP and residual. (1) and (3) are many small operations on
one row, the overhead that keeps the one-token step above its matmul time; (2) has shapes that change every step.
This job compiles (1) and (3) (torch.compile, dynamic shapes, for every layer: one graph each), keeps (2) eager,
and reports, side by side in one process:
- milliseconds of a one-token step, eager and compiled (medians, after a warm-up), and the first compiled call;
- whether the compiled step's logits equal the eager step's bitwise, and whether a row of a compiled T-row causal
  step equals the compiled one-row step (the batch invariance that exact lookahead needs).

    python -m scripts.bench.compile_regions --quantize int4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from minilade.invariance import KeyLayout, invariant_attention, padded_views
from minilade.model import Block, Transformer, apply_rope

from .one_token_step import cpu_flags, load_model, positive, step_parser


def before_attention(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Region (1): x (B, T, dim) -> q (B, H, T, D), k, v (B, Hkv, T, D), as Attention.forward computes them."""
    a = block.attention
    B, T, _ = x.shape
    qkv = a.wqkv(block.attention_norm(x)).view(B, T, a.n_heads + 2 * a.n_kv_heads, a.head_dim)
    n_qk = a.n_heads + a.n_kv_heads
    qk = apply_rope(qkv[:, :, :n_qk], cos, sin).transpose(1, 2)
    return qk[:, :a.n_heads], qk[:, a.n_heads:], qkv[:, :, n_qk:].transpose(1, 2)


def after_attention(block: Block, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Region (3): the residual stream after the layer, from x and attention's output y (B, H, T, D)."""
    B, T = x.shape[:2]
    x = x + block.attention.wo(y.transpose(1, 2).reshape(B, T, -1))
    return x + block.feed_forward(block.ffn_norm(x))


@contextmanager
def regions(model: Transformer, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Every layer runs decoding steps (those with a KeyLayout) through wrap(region) for regions (1) and (3);
    other calls (the prefill) as before. Restored on exit."""
    first, last = wrap(before_attention), wrap(after_attention)

    def forward(block, x, cos, sin, cache, layer, kernel, step):
        if not isinstance(step, KeyLayout):
            return Block.forward(block, x, cos, sin, cache, layer, kernel, step)
        q, k, v = first(block, x, cos, sin)
        cache.write(layer, k, v)
        return last(block, x, invariant_attention(q, *padded_views(cache, layer, step.keys), step))

    for block in model.layers:
        block.forward = types.MethodType(forward, block)
    try:
        yield
    finally:
        for block in model.layers:
            del block.forward


def run_steps(model: Transformer, context: int, steps: int, width: int = 1) -> tuple[list[float], list[torch.Tensor]]:
    """Seconds and first-row logits of `steps` causal steps of `width` rows after a random context; each step
    commits its first row, so the k-th step's first row is the same token at the same place for every width."""
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(context + steps + width)
    model(torch.randint(0, model.config.vocab_size, (1, context), generator=gen), torch.arange(context), cache)
    cache.commit(context)
    times, rows = [], []
    for i in range(steps):
        tokens = torch.full((1, width), 5 + i)
        start = time.perf_counter()
        logits = model(tokens, torch.arange(width) + cache.length, cache)
        times.append(time.perf_counter() - start)
        cache.commit(1)
        rows.append(logits[0, 0])
    return times, rows


def compiled(model: Transformer, args: argparse.Namespace, eager_rows: list[torch.Tensor], warm: int) -> dict:
    """The compiled regions' step time, first call, and bitwise comparisons (see the module docstring)."""
    with regions(model, lambda fn: torch.compile(fn, dynamic=True)):
        start = time.perf_counter()
        run_steps(model, args.context, 1)
        first_s = time.perf_counter() - start
        compiled_s, compiled_rows = run_steps(model, args.context, args.steps)
        _, wide_rows = run_steps(model, args.context, args.steps, args.width)
    return dict(compiled_ms=1e3 * statistics.median(compiled_s[warm:]), first_compiled_call_s=first_s,
                compiled_equals_eager=all(map(torch.equal, compiled_rows, eager_rows)),
                wide_row_equals_one_row=all(map(torch.equal, wide_rows, compiled_rows)))


def main(argv: Sequence[str] | None = None) -> int:
    p = step_parser(__doc__, steps=30)
    p.add_argument("--width", type=positive, default=8, help="rows of the wide steps checked for invariance")
    args = p.parse_args(argv)
    model, warm = load_model(args), 5
    with torch.inference_mode():
        eager_s, eager_rows = run_steps(model, args.context, args.steps)
        result = dict(quantize=args.quantize, threads=args.threads, cpu_flags=cpu_flags(),
                      eager_ms=1e3 * statistics.median(eager_s[warm:]))
        try:
            result.update(compiled(model, args, eager_rows, warm))
        except Exception as exc:  # inductor's lowering errors: the finding is that it does not compile
            result["compile_failed"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
