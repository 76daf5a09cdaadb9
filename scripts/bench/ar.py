"""Autoregressive throughput: minilade against transformers generate, and the weight bytes read per second against
this machine's memory bandwidth.

    python -m scripts.bench.ar --dtypes float32 bfloat16
    python -m scripts.bench.ar --quick              # smoke test: 1 prompt a dataset x 8 tokens, float32

Per --dtypes, minilade autoregressive and transformers generate on the same weights, timed side by side
(scripts/bench/timing.py: warm-up, shuffled order, --repeats, medians, paired per-prompt ratios), plus
transformers' prefill alone (max_new_tokens=1) to split its decode time off. Reports tokens per second, their
ratio, decode-only tokens per second, and the weight bytes one step reads per second next to this machine's
measured memory bandwidth. Writes ar_results.json to --out-dir.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from minilade import LLM, Autoregressive
from minilade.checkpoints import resolve_checkpoint
from minilade.config import ModelConfig

from .common import (
    CPU_DTYPES,
    JobParser,
    add_prompt_options,
    add_timed_options,
    encode_prompts,
    fmt,
    load_average,
    load_prompt_texts,
    median_seconds,
    options_record,
    parse_with_quick,
    positive_int,
    run_timed_job,
    write_json,
)
from .contenders import (
    AR,
    HF_GENERATE,
    HF_PREFILL,
    Contender,
    Runner,
    import_transformers,
    load_hf_model,
)
from .timing import (
    PromptResult,
    exact_matches,
    group_by_prompt,
    measure,
    paired_speedup,
    warm_up,
)

MODULE = "scripts.bench.ar"
QUICK_DEFAULTS = dict(n_prompts=1, max_new_tokens=8, repeats=1, bandwidth_mib=64, dtypes=["float32"])
ITEMSIZE = {"float32": 4, "bfloat16": 2}


def build_parser() -> argparse.ArgumentParser:
    p = JobParser(MODULE, __doc__)
    add_prompt_options(p, n_prompts=20)
    p.add_argument("--dtypes", nargs="+", choices=CPU_DTYPES, default=list(CPU_DTYPES), help="the weights' dtypes")
    p.add_argument("--bandwidth-mib", type=positive_int, default=1024, help="buffer size for the bandwidth test")
    add_timed_options(p, QUICK_DEFAULTS)
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return parse_with_quick(build_parser(), argv, QUICK_DEFAULTS)


def contenders(with_transformers: bool) -> list[Contender]:
    rows = [Contender(AR, "minilade", Autoregressive())]
    if with_transformers:
        rows += [Contender(HF_GENERATE, "transformers"), Contender(HF_PREFILL, "transformers", max_new_tokens=1)]
    return rows


# ---- memory ----------------------------------------------------------------------------------------------------

def measure_bandwidth(mib: int, reps: int = 5, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """This machine's memory bandwidth in GB/s (1e9 bytes/s), median of reps after a warm-up: reading a buffer
    (torch sum) and copying it (read + write, both counted)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read = nbytes / median_seconds(src.sum, reps, clock) / 1e9
    copy = 2 * nbytes / median_seconds(lambda: dst.copy_(src), reps, clock) / 1e9
    return {"buffer_mib": mib, "read_gb_s": read, "copy_gb_s": copy}


def weight_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """Bytes of weights one decode step reads: every parameter except the input embedding table (a decode step
    looks up one row of it); the output head is read whole, so a tied embedding counts once, as the head."""
    untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.dim
    return (config.n_params - untied_embedding) * ITEMSIZE[dtype]


# ---- summary and table -----------------------------------------------------------------------------------------

def summarize(records: list[dict], dtype: str, config: ModelConfig, bandwidth: dict[str, float]) -> list[dict]:
    """One row per library: end-to-end and decode-only tokens/s, minilade's paired speedup over transformers, and
    the weight bytes read per second during decoding. Decode-only: minilade's own prefill/decode split; for
    transformers, each prompt's wall time minus its median prefill-only (max_new_tokens=1) time."""
    grouped = group_by_prompt(records)

    def pooled(label: str) -> dict[tuple[str, int], PromptResult]:
        """One contender's results over every dataset, keyed by (dataset, prompt)."""
        return {(d, p): r for (d, _, c), by_prompt in grouped.items() if c == label for p, r in by_prompt.items()}

    ours, theirs, prefill = pooled(AR), pooled(HF_GENERATE), pooled(HF_PREFILL)
    ours_decode_s = sum(r.decode_s for r in ours.values())
    rows = [library_row(dtype, AR, ours, ours_decode_s, config, bandwidth)]
    rows[0]["minilade_over_transformers"] = paired_speedup(ours, theirs)
    if theirs:
        theirs_decode_s = sum(r.wall_s - prefill[p].wall_s for p, r in theirs.items())
        rows.append(library_row(dtype, HF_GENERATE, theirs, theirs_decode_s, config, bandwidth))
        rows[-1]["exact_match"] = exact_matches(theirs, ours)
    return rows


def library_row(dtype: str, label: str, results: dict[Any, PromptResult], decode_s: float, config: ModelConfig,
                bandwidth: dict[str, float]) -> dict:
    new_tokens = sum(r.new_tokens for r in results.values())
    decode_tps = (new_tokens - len(results)) / decode_s if decode_s > 0 else None  # the first token is the prefill's
    weight_bytes = weight_bytes_per_token(config, dtype)
    return dict(dtype=dtype, library=label, n_prompts=len(results), new_tokens=new_tokens,
                tokens_per_s=new_tokens / sum(r.wall_s for r in results.values()), decode_tokens_per_s=decode_tps,
                minilade_over_transformers=None, exact_match=None, weight_bytes_per_token=weight_bytes,
                weight_gb_s=weight_bytes * decode_tps / 1e9 if decode_tps else None,
                measured_read_gb_s=bandwidth["read_gb_s"])


def ar_table(rows: list[dict], bandwidth: dict[str, float]) -> str:
    lines = [f"\nmemory bandwidth, measured on a {bandwidth['buffer_mib']} MiB buffer: "
             f"read {bandwidth['read_gb_s']:.1f} GB/s, copy (read + write) {bandwidth['copy_gb_s']:.1f} GB/s\n",
             "| dtype | library | new tokens | tokens/s | decode tokens/s | minilade / transformers "
             "| weight MB/token | weight GB/s | of read bandwidth | exact match |", "|" + " --- |" * 10]
    for r in rows:
        share = f"{r['weight_gb_s'] / r['measured_read_gb_s']:.0%}" if r["weight_gb_s"] else ""
        exact = "" if r["exact_match"] is None else f"{r['exact_match']}/{r['n_prompts']}"
        lines.append(f"| {r['dtype']} | {r['library']} | {r['new_tokens']} | {r['tokens_per_s']:.1f} "
                     f"| {fmt(r['decode_tokens_per_s'], '.1f')} | {fmt(r['minilade_over_transformers'], '.2f')} "
                     f"| {r['weight_bytes_per_token'] / 1e6:.0f} | {fmt(r['weight_gb_s'], '.2f')} | {share} "
                     f"| {exact} |")
    return "\n".join(lines)


# ---- the job ---------------------------------------------------------------------------------------------------

def measure_dtype(args: argparse.Namespace, ckpt_path: Path, texts: dict[str, list[str]], dtype: str
                  ) -> tuple[ModelConfig, list[dict]]:
    """Both libraries in one dtype, side by side: the model's config and the timed records."""
    llm = LLM.load(ckpt_path, dtype=dtype, device="cpu")
    prompts = encode_prompts(llm, texts, show_progress=not args.no_progress)
    runner = Runner(llm, None if args.no_transformers else load_hf_model(ckpt_path, dtype))
    by_temperature = {0.0: contenders(not args.no_transformers)}
    warm_up(runner, by_temperature, prompts, args.max_new_tokens)
    records = measure(runner, prompts, by_temperature, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                      seed=args.seed, desc=f"ar {dtype}", show_progress=not args.no_progress)
    return llm.model.config, records


def run(args: argparse.Namespace, command: str, env: dict) -> dict:
    """Every dtype in turn; prints the table, writes ar_results.json, returns the document."""
    if not args.no_transformers:
        import_transformers()
    texts = load_prompt_texts(args.data_dir, args.datasets, args.n_prompts)
    ckpt_path = resolve_checkpoint(args.ckpt)
    bandwidth = measure_bandwidth(args.bandwidth_mib)
    rows, records = [], []
    for dtype in args.dtypes:
        config, dtype_records = measure_dtype(args, ckpt_path, texts, dtype)
        rows += summarize(dtype_records, dtype, config, bandwidth)
        records += [dict(r, dtype=dtype) for r in dtype_records]
    print(ar_table(rows, bandwidth))
    document = dict(command=command, mode="ar", checkpoint=str(ckpt_path),
                    environment=dict(env, load_average_1m_end=load_average()), settings=options_record(args),
                    bandwidth=bandwidth, summary=rows, records=records)
    write_json(args.out_dir / "ar_results.json", document)
    return document


def main(argv: Sequence[str] | None = None) -> int:
    return run_timed_job(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
