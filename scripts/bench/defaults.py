"""The default configuration against the ones it replaced or could be: greedy, side by side on each prompt.

Configurations (demo model): float32 eager auto (the default before quantize="auto"), the file's int4 codes eager
(auto and plain decoding: today's default), the same with compiled steps (LLM.load(compile=True)). For each prompt
set: end-to-end tokens/s (prefill included), medians over prompts of the ratio to float32 eager auto, and on how
many prompts auto's tokens equal plain decoding's in the same configuration.

    python -m scripts.bench.defaults --data-dir ../shared/data --n-prompts 4 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from minilade.llm import LLM

from .one_token_step import cpu_flags

SETS = {"mt_bench": ("mt_bench.jsonl", lambda r: r["turns"][0], True),
        "humaneval": ("humaneval.jsonl", lambda r: r["prompt"], False),
        "gsm8k": ("gsm8k_test.jsonl", lambda r: r["question"], True)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--n-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    f32 = LLM.load(dtype="float32", quantize=None, progress=False)
    int4 = LLM.load(progress=False)
    int4_compiled = LLM.load(progress=False, compile=True)
    configs = {"float32 auto": (f32, "auto"), "int4 auto": (int4, "auto"), "int4 plain": (int4, "autoregressive"),
               "int4 compiled auto": (int4_compiled, "auto"), "int4 compiled plain": (int4_compiled, "autoregressive")}
    for llm in (f32, int4, int4_compiled):  # warm-up: step costs measured, graphs traced
        for strategy in ("auto", "autoregressive"):
            llm.generate("Hello", chat=True, max_new_tokens=8, strategy=strategy)
    print(f"CPU flags: {cpu_flags()}\nsetups: " + " | ".join(llm.setup for llm in (f32, int4, int4_compiled)))
    results = {}
    for name, (file, field, chat) in SETS.items():
        lines = (args.data_dir / file).read_text().splitlines()[:args.n_prompts]
        rate = {c: [] for c in configs}
        same = {"int4": 0, "int4 compiled": 0}
        for prompt in (field(json.loads(line)) for line in lines):
            tokens = {}
            for c, (llm, strategy) in configs.items():
                g = llm.generate(prompt, chat=chat, max_new_tokens=args.max_new_tokens, strategy=strategy)
                rate[c].append(g.stats.new_tokens / (g.stats.prefill_s + g.stats.decode_s))
                tokens[c] = g.token_ids
            for kind in same:
                same[kind] += tokens[f"{kind} auto"] == tokens[f"{kind} plain"]
        base = rate["float32 auto"]
        results[name] = {c: {"tokens_per_s": round(statistics.median(r), 1),
                             "vs_float32_auto": round(statistics.median(a / b for a, b in zip(r, base)), 2)}
                         for c, r in rate.items()}
        results[name]["auto identical to plain"] = {k: f"{v}/{len(lines)}" for k, v in same.items()}
        print(name, json.dumps(results[name]), flush=True)
    print(json.dumps({"cpu_flags": cpu_flags(), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
