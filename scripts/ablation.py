#!/usr/bin/env python3
"""Where does minilade's compression over the published reference come from?

Greedy lookahead at each --settings, on the prompt sets, in four variants that differ only in the two things the
reference does differently (see ../shared/LOOKAHEAD.md):
- minilade: the bonus token (a step whose candidate matches entirely also emits the model's next token) and the
  n-gram pool seeded from the prompt (so verification can start on the first step);
- no bonus token: a fully matched candidate yields N - 1 tokens, as in the reference;
- no prompt pool: the pool starts empty and is fed by the window and the generated text only;
- reference-like: neither.
Compression is new tokens / forward passes, prefill included. Greedy output is the same in every variant (each
is exact), so only the number of forward passes differs; the script checks that too. Nothing is timed.

    python scripts/ablation.py --settings 7,5,7 --n-prompts 20
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from minilade import LLM, Lookahead

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exactness import load_prompts, missing_prompt_sets, prompt_set_parser  # noqa: E402  (a sibling script)

VARIANTS = {
    "minilade": lambda s: Lookahead(*s),
    "no bonus token": lambda s: Lookahead(*s, bonus_token=False),
    "no prompt pool": lambda s: Lookahead(*s, pool_from_prompt=False),
    "reference-like": lambda s: Lookahead(*s, bonus_token=False, pool_from_prompt=False),
}


def measure(llm: LLM, prompts: dict[str, list[list[int]]], settings: list[tuple[int, int, int]],
            max_new_tokens: int) -> list[dict]:
    records = []
    total = sum(len(v) for v in prompts.values()) * len(settings) * len(VARIANTS)
    with torch.inference_mode(), tqdm(total=total, desc="ablation", file=sys.stderr) as bar:
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


def main(argv: Sequence[str] | None = None) -> int:
    args = prompt_set_parser(__doc__, n_prompts=20).parse_args(argv)
    missing = missing_prompt_sets(args)
    if missing:
        print(f"error: prompt set not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    settings = [tuple(int(v) for v in s.split(",")) for s in args.settings]
    llm = LLM.load(args.ckpt, dtype="float32", device="cpu", progress=False)
    prompts = {name: load_prompts(llm, args.data_dir, name, args.n_prompts) for name in args.datasets}
    records = measure(llm, prompts, settings, args.max_new_tokens)
    print("\nfloat32, greedy, compression = new tokens / forward passes (prefill included)\n")
    print(table(records))
    if args.out:
        command = " ".join(["python scripts/ablation.py", *(argv if argv is not None else sys.argv[1:])])
        args.out.write_text(json.dumps(dict(command=command, records=records), indent=1))
    return 0 if all(r["same_output"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
