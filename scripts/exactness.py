#!/usr/bin/env python3
"""Where does greedy lookahead output differ from greedy autoregressive output, and why?

For each prompt of the prompt sets, generate greedily with plain decoding and with lookahead at each --settings,
and compare token ids. For every divergence, report the first differing position and the autoregressive
model's margin there (top-1 minus top-2 logit): lookahead computes the same function on differently shaped
matrix products, so their results differ by rounding only, and an argmax can flip only where two logits are
closer than that rounding. In float32 that almost never happens; in bfloat16 (8 bits of mantissa) it does.

    python scripts/exactness.py --dtype float32 --n-prompts 10 --settings 7,5,7 3,3,3
    python scripts/exactness.py --dtype bfloat16 --n-prompts 10 --settings 7,5,7
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from minilade import LLM, Lookahead
from minilade.checkpoints import DEFAULT_CHECKPOINT

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS = {  # name -> (file, field, chat template)
    "mt_bench": ("mt_bench.jsonl", "turns", True),
    "humaneval": ("humaneval.jsonl", "prompt", False),
    "gsm8k": ("gsm8k_test.jsonl", "question", True),
}


def load_prompts(llm: LLM, data_dir: Path, name: str, n: int) -> list[list[int]]:
    file, field, chat = DATASETS[name]
    path = data_dir / file
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [llm.encode(r[field][0] if field == "turns" else r[field], chat=chat) for r in rows]


def margin_at(llm: LLM, prompt: list[int], generated: list[int], position: int) -> float:
    """Top-1 minus top-2 logit of the plain forward pass that chose generated[position]."""
    tokens = torch.tensor([prompt + generated[:position]])
    with torch.inference_mode():
        logits = llm.model(tokens, torch.arange(tokens.shape[1]), llm.model.new_cache(tokens.shape[1]),
                           logits_rows=torch.tensor([tokens.shape[1] - 1]))[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def prompt_set_parser(description: str, n_prompts: int) -> argparse.ArgumentParser:
    """The options this script shares with ablation.py: checkpoint, prompt sets, budget, settings, output."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT)
    p.add_argument("--data-dir", type=Path, default=(REPO_ROOT / ".." / "shared" / "data").resolve())
    p.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    p.add_argument("--n-prompts", type=int, default=n_prompts)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--settings", nargs="+", default=["7,5,7"], metavar="W,N,G")
    p.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    return p


def missing_prompt_sets(args: argparse.Namespace) -> list[str]:
    return [str(args.data_dir / DATASETS[name][0]) for name in args.datasets
            if not (args.data_dir / DATASETS[name][0]).is_file()]


def main(argv: Sequence[str] | None = None) -> int:
    p = prompt_set_parser(__doc__, n_prompts=10)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    missing = missing_prompt_sets(args)
    if missing:
        print(f"error: prompt set not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    settings = [tuple(int(v) for v in s.split(",")) for s in args.settings]
    llm = LLM.load(args.ckpt, dtype=args.dtype, device="cpu", progress=False)
    prompts = {name: load_prompts(llm, args.data_dir, name, args.n_prompts) for name in args.datasets}
    records = []
    total = sum(len(v) for v in prompts.values())
    with tqdm(total=total * (1 + len(settings)), desc=f"exactness {args.dtype}", file=sys.stderr) as bar:
        for name, group in prompts.items():
            for i, prompt in enumerate(group):
                reference = llm.generate(prompt, max_new_tokens=args.max_new_tokens).token_ids
                bar.update()
                for setting in settings:
                    got = llm.generate(prompt, max_new_tokens=args.max_new_tokens, strategy=Lookahead(*setting))
                    bar.update()
                    first = next((j for j, (a, b) in enumerate(zip(reference, got.token_ids)) if a != b), None)
                    if first is None and len(reference) != len(got.token_ids):
                        first = min(len(reference), len(got.token_ids))
                    record = dict(dataset=name, prompt=i, setting=setting, same=first is None, first_diff=first,
                                  tokens=len(reference))
                    if first is not None and first < len(reference):
                        record["margin"] = margin_at(llm, prompt, reference, first)
                    records.append(record)
    print(f"\n{args.dtype}, {args.max_new_tokens} new tokens, greedy lookahead vs greedy autoregressive\n")
    print("| dataset | setting | identical | first difference at (margin of the top-2 logits there) |")
    print("| --- | --- | --- | --- |")
    for name in prompts:
        for setting in settings:
            rows = [r for r in records if r["dataset"] == name and r["setting"] == setting]
            diffs = ", ".join(f"#{r['prompt']}: token {r['first_diff']} ({r.get('margin', float('nan')):.3f})"
                              for r in rows if not r["same"])
            print(f"| {name} | {setting} | {sum(r['same'] for r in rows)}/{len(rows)} | {diffs or '-'} |")
    if args.out:
        command = " ".join(["python scripts/exactness.py", *(argv if argv is not None else sys.argv[1:])])
        args.out.write_text(json.dumps(dict(command=command, dtype=args.dtype, records=records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
