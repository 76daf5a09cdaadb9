"""The default configuration against the ones it replaced or could be: greedy, side by side on each prompt.

Setups (demo model): LLM.load()'s defaults (chosen by what measures fastest here: w7a8 layers with native steps on
the machines measured), float32 eager (the default before quantize="auto"; auto only), the file's int4 codes eager,
the same with compiled steps (LLM.load(compile=True)), and w7a8 layers (integer matmuls), eager and compiled; each
but float32 with auto and plain decoding. For each prompt set: end-to-end tokens/s (prefill included), medians over
prompts of the ratio to float32 eager auto, and on how many prompts auto's tokens equal plain decoding's in the same
setup.

    python -m scripts.bench.defaults --data-dir ../shared/data --n-prompts 4 --max-new-tokens 128
    python -m scripts.bench.defaults --data-dir ../shared/data --setups int4 w7a8   # float32 always runs
    python -m scripts.bench.defaults --data-dir ../shared/data --setups default "w7a8 compiled" --n-prompts 20
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
SETUPS = {"default": dict(), "float32": dict(dtype="float32", quantize=None, compile=False),
          "int4": dict(quantize="int4", compile=False),
          "int4 compiled": dict(quantize="int4", compile=True),
          "w7a8": dict(quantize="w7a8", compile=False), "w7a8 compiled": dict(quantize="w7a8", compile=True)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--n-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    args = p.parse_args(argv)
    llms = {name: LLM.load(progress=False, **SETUPS[name]) for name in ["float32", *args.setups]}
    configs = {"float32 auto": (llms["float32"], "auto")}
    for name in args.setups:
        configs.update({f"{name} auto": (llms[name], "auto"), f"{name} plain": (llms[name], "autoregressive")})
    for llm in llms.values():  # warm-up: step costs measured, graphs traced
        for strategy in ("auto", "autoregressive"):
            llm.generate("Hello", chat=True, max_new_tokens=8, strategy=strategy)
    print(f"CPU flags: {cpu_flags()}\nsetups: " + " | ".join(f"{n}: {llm.setup}" for n, llm in llms.items()))
    results = {}
    for name, (file, field, chat) in SETS.items():
        lines = (args.data_dir / file).read_text().splitlines()[:args.n_prompts]
        rate = {c: [] for c in configs}
        same = dict.fromkeys(args.setups, 0)
        for prompt in (field(json.loads(line)) for line in lines):
            tokens = {}
            for c, (llm, strategy) in configs.items():
                llm.drop_kept_rows()  # each reads the whole prompt, as it does alone
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
