"""Where does greedy lookahead output differ from greedy autoregressive output, and why?

For each prompt of the prompt sets, generate greedily with plain decoding and with lookahead at each --settings,
and compare token ids. For every divergence, report the first differing position and the autoregressive
model's margin there (top-1 minus top-2 logit): lookahead computes the same function on differently shaped
matrix products, so their results differ by rounding only, and an argmax can flip only where two logits are
closer than that rounding. In float32 that almost never happens; in bfloat16 (8 bits of mantissa) it does.

    python -m scripts.bench.exactness --dtype float32 --n-prompts 10 --settings 7,5,7 3,3,3
    python -m scripts.bench.exactness --dtype bfloat16 --n-prompts 10 --settings 7,5,7
    python -m scripts.bench.exactness --dtype bfloat16 --skip 5 --n-prompts 5 --auto   # prompts 5..9, auto too

--skip lets a long run go in chunks (each writes its own --out), so other jobs get the CPU between them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import torch

from minilade import LLM, Auto, Autoregressive, Lookahead, Strategy

from .common import (
    CPU_DTYPES,
    JobParser,
    Setting,
    UsageError,
    add_prompt_options,
    add_settings_option,
    command_line,
    encode_prompts,
    load_prompt_texts,
    progress,
    run_job,
    write_json,
)

MODULE = "scripts.bench.exactness"


def build_parser() -> argparse.ArgumentParser:
    p = JobParser(MODULE, __doc__)
    add_prompt_options(p, n_prompts=10)
    add_settings_option(p, [(7, 5, 7)])
    p.add_argument("--dtype", choices=CPU_DTYPES, default="float32")
    p.add_argument("--skip", type=int, default=0, help="leave out the first K prompts of each dataset")
    p.add_argument("--auto", action="store_true", help="also compare auto (default settings) with plain decoding")
    p.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    return p


def first_difference(reference: Sequence[int], got: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (the shorter one's length where one is a prefix of the
    other); None where they are equal."""
    first = next((j for j, (a, b) in enumerate(zip(reference, got)) if a != b), None)
    if first is None and len(reference) != len(got):
        first = min(len(reference), len(got))
    return first


def margin_at(llm: LLM, prompt: list[int], generated: list[int], position: int) -> float:
    """Top-1 minus top-2 logit of the plain forward pass that chose generated[position]."""
    tokens = torch.tensor([prompt + generated[:position]])
    with torch.inference_mode():
        logits = llm.model(tokens, torch.arange(tokens.shape[1]), llm.model.new_cache(tokens.shape[1]),
                           logits_rows=torch.tensor([tokens.shape[1] - 1]))[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare(llm: LLM, prompts: dict[str, list[list[int]]], settings: list[Setting], max_new_tokens: int,
            show_progress: bool, desc: str, auto: bool = False, first_index: int = 0) -> list[dict]:
    """One record per (prompt, setting): whether lookahead (and auto, when asked; its setting is "auto") gave the
    autoregressive tokens, and if not, where and with what margin they part. Prompts are numbered from
    first_index."""
    strategies: list[tuple[Setting | str, Strategy]] = [(s, Lookahead(*s)) for s in settings]
    strategies += [("auto", Auto())] if auto else []
    records = []
    total = sum(len(v) for v in prompts.values()) * (1 + len(strategies))
    with progress(total, desc, show_progress) as bar:
        for name, group in prompts.items():
            for i, prompt in enumerate(group, start=first_index):
                reference = llm.generate(prompt, max_new_tokens=max_new_tokens, strategy=Autoregressive()).token_ids
                bar.update()
                for setting, strategy in strategies:
                    got = llm.generate(prompt, max_new_tokens=max_new_tokens, strategy=strategy)
                    bar.update()
                    first = first_difference(reference, got.token_ids)
                    record = dict(dataset=name, prompt=i, setting=setting, same=first is None, first_diff=first,
                                  tokens=len(reference))
                    if first is not None and first < len(reference):
                        record["margin"] = margin_at(llm, prompt, reference, first)
                    records.append(record)
    return records


def table(records: list[dict]) -> str:
    lines = ["| dataset | setting | identical | first difference at (margin of the top-2 logits there) |",
             "| --- | --- | --- | --- |"]
    for name, setting in dict.fromkeys((r["dataset"], r["setting"]) for r in records):
        rows = [r for r in records if r["dataset"] == name and r["setting"] == setting]
        diffs = ", ".join(f"#{r['prompt']}: token {r['first_diff']} ({r.get('margin', float('nan')):.3f})"
                          for r in rows if not r["same"])
        lines.append(f"| {name} | {setting} | {sum(r['same'] for r in rows)}/{len(rows)} | {diffs or '-'} |")
    return "\n".join(lines)


def job(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.skip < 0:
        raise UsageError(f"--skip must be >= 0, got {args.skip}")
    texts = load_prompt_texts(args.data_dir, args.datasets, args.skip + args.n_prompts)
    texts = {name: items[args.skip:] for name, items in texts.items()}
    llm = LLM.load(args.ckpt, dtype=args.dtype, device="cpu", progress=False, compile=False)
    prompts = encode_prompts(llm, texts, show_progress=not args.no_progress)
    records = compare(llm, prompts, args.settings, args.max_new_tokens, not args.no_progress,
                      desc=f"exactness {args.dtype}", auto=args.auto, first_index=args.skip)
    print(f"\n{args.dtype}, {args.max_new_tokens} new tokens, greedy lookahead vs greedy autoregressive\n")
    print(table(records))
    if args.out:
        write_json(args.out, dict(command=command_line(MODULE, argv), dtype=args.dtype, records=records), indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())
