"""Where does minilade's compression over the published reference come from?

Greedy lookahead at each --settings, on the prompt sets, in four variants that differ only in the two things the
reference does differently (see ../shared/LOOKAHEAD.md):
- minilade: the bonus token (a step whose candidate matches entirely also emits the model's next token) and the
  n-gram pool seeded from the prompt (so verification can start on the first step);
- no bonus token: a fully matched candidate yields N - 1 tokens, as in the reference;
- no prompt pool: the pool starts empty and is fed by the window and the generated text only;
- reference-like: neither.
Compression is new tokens / forward passes, prefill included. Greedy output is the same in every variant (each
is exact), so only the number of forward passes differs; the job checks that too (exit status 1 if not). Nothing
is timed.

    python -m scripts.bench.ablation --settings 7,5,7 --n-prompts 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import torch

from minilade import LLM, Lookahead

from .common import (
    JobParser,
    Setting,
    add_prompt_options,
    add_settings_option,
    command_line,
    encode_prompts,
    load_prompt_texts,
    progress,
    run_job,
    write_json,
)

MODULE = "scripts.bench.ablation"
VARIANTS = {
    "minilade": lambda s: Lookahead(*s),
    "no bonus token": lambda s: Lookahead(*s, bonus_token=False),
    "no prompt pool": lambda s: Lookahead(*s, pool_from_prompt=False),
    "reference-like": lambda s: Lookahead(*s, bonus_token=False, pool_from_prompt=False),
}


def build_parser() -> argparse.ArgumentParser:
    p = JobParser(MODULE, __doc__)
    add_prompt_options(p, n_prompts=20)
    add_settings_option(p, [(7, 5, 7)])
    p.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    return p


def measure(llm: LLM, prompts: dict[str, list[list[int]]], settings: list[Setting], max_new_tokens: int,
            show_progress: bool = True) -> list[dict]:
    """One record per (prompt, setting, variant): new tokens, forward passes, the most tokens a step emitted, and
    whether the output equals the minilade variant's."""
    records = []
    total = sum(len(v) for v in prompts.values()) * len(settings) * len(VARIANTS)
    with torch.inference_mode(), progress(total, "ablation", show_progress) as bar:
        for name, group in prompts.items():
            for i, prompt in enumerate(group):
                for setting in settings:
                    outputs = {}
                    for variant, make in VARIANTS.items():
                        out = llm.generate(prompt, max_new_tokens=max_new_tokens, strategy=make(setting))
                        outputs[variant] = out.token_ids
                        records.append(dict(
                            dataset=name, prompt=i, setting=setting, variant=variant, new_tokens=len(out.token_ids),
                            forward_passes=out.stats.forward_passes, most_per_step=max(out.stats.tokens_per_step),
                            same_output=out.token_ids == outputs["minilade"]))
                        bar.update()
    return records


def table(records: list[dict]) -> str:
    """Compression (new tokens / forward passes, summed over prompts) per (dataset, setting) and variant."""
    lines = ["| dataset | setting | " + " | ".join(VARIANTS) + " | same output |", "|" + " --- |" * (len(VARIANTS) + 3)]
    for name, setting in dict.fromkeys((r["dataset"], r["setting"]) for r in records):
        rows = [r for r in records if r["dataset"] == name and r["setting"] == setting]
        cells = []
        for variant in VARIANTS:
            mine = [r for r in rows if r["variant"] == variant]
            cells.append(f"{sum(r['new_tokens'] for r in mine) / sum(r['forward_passes'] for r in mine):.2f}")
        same = "yes" if all(r["same_output"] for r in rows) else "NO"
        lines.append(f"| {name} | {setting} | {' | '.join(cells)} | {same} |")
    return "\n".join(lines)


def job(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    texts = load_prompt_texts(args.data_dir, args.datasets, args.n_prompts)
    llm = LLM.load(args.ckpt, dtype="float32", device="cpu", progress=False, compile=False)
    prompts = encode_prompts(llm, texts, show_progress=not args.no_progress)
    records = measure(llm, prompts, args.settings, args.max_new_tokens, not args.no_progress)
    print("\nfloat32, greedy, compression = new tokens / forward passes (prefill included)\n")
    print(table(records))
    if args.out:
        write_json(args.out, dict(command=command_line(MODULE, argv), records=records), indent=1)
    return 0 if all(r["same_output"] for r in records) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())
