"""A chat of several turns through LLM.generate, each turn resending the whole conversation: its prompt read from the
keys and values the last turn left (what the library does) against read whole (`drop_kept_rows` before each turn).

    python -m scripts.bench.turns --turns 6 --rounds 2

The turns are the first questions of MT-Bench, one a turn, each answered greedily with `--strategy`. Two LLMs over one
model hold the two conversations, so each keeps only its own rows; in each turn the one that goes first alternates,
and the two answers must be equal (the same tokens, else the run stops). A figure is the median over rounds of a
turn's prefill (the time to its first token) and of the whole turn. Prints a table and writes turns.json (every
round) and turns.png under --out-dir.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from minilade import LLM

from .common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    JobParser,
    load_prompt_texts,
    positive_int,
    progress,
    run_timed_job,
    write_json,
    write_png,
)
from .plots import import_figure

MODULE = "scripts.bench.turns"
WAYS = ("kept", "whole")  # the prompt read from the last turn's rows, or read whole


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = JobParser(MODULE, __doc__)
    p.add_argument("--ckpt", default=None, help="a .gguf file or a checkpoint folder (default: the CLI's)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="folder of the jsonl prompt sets")
    p.add_argument("--turns", type=positive_int, default=6, help="turns of the chat: MT-Bench's first N questions")
    p.add_argument("--rounds", type=positive_int, default=2, help="timed chats, after one short one that warms up")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--strategy", default="auto", choices=["auto", "autoregressive", "lookahead"])
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return p.parse_args(argv)


def chat_round(llms: dict[str, LLM], questions: list[str], first: int, options: dict, bar: Any) -> list[dict]:
    """One chat of every question, each way; `first` picks which way goes first in the first turn (then it
    alternates). A record per turn: prompt tokens, tokens kept, prefill and turn seconds each way."""
    conversations: dict[str, list[dict]] = {way: [] for way in WAYS}
    records = []
    for t, question in enumerate(questions):
        order = WAYS if (t + first) % 2 == 0 else WAYS[::-1]
        got = {}
        for way in order:
            if way == "whole":
                llms[way].drop_kept_rows()
            messages = conversations[way] + [{"role": "user", "content": question}]
            start = time.perf_counter()
            generation = llms[way].generate(messages, **options)
            got[way] = (generation, time.perf_counter() - start)
            conversations[way] = messages + [{"role": "assistant", "content": generation.text}]
            bar.update()
        kept, whole = got["kept"][0], got["whole"][0]
        if kept.token_ids != whole.token_ids:
            raise SystemExit(f"turn {t + 1}: the answer read from kept rows differs from the one read whole")
        records.append({"turn": t + 1, "order": list(order), "prompt_tokens": kept.stats.prompt_tokens,
                        "kept_tokens": kept.stats.kept_tokens, "new_tokens": len(kept.token_ids),
                        "prefill_s": {way: got[way][0].stats.prefill_s for way in WAYS},
                        "turn_s": {way: got[way][1] for way in WAYS}})
    return records


def summary(rounds: list[list[dict]]) -> list[dict]:
    """Per turn, the medians over rounds."""
    rows = []
    for turn in zip(*rounds):
        rows.append({"turn": turn[0]["turn"], "prompt_tokens": turn[0]["prompt_tokens"],
                     "kept_tokens": turn[0]["kept_tokens"],
                     **{f"{what}_{way}": statistics.median(r[f"{what}_s"][way] for r in turn)
                        for what in ("prefill", "turn") for way in WAYS}})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| turn | prompt tokens | kept | prefill kept / whole, ms | x | turn kept / whole, s | x |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']} | {r['kept_tokens']} | "
                     f"{r['prefill_kept'] * 1e3:.0f} / {r['prefill_whole'] * 1e3:.0f} | "
                     f"x{r['prefill_whole'] / r['prefill_kept']:.1f} | {r['turn_kept']:.2f} / {r['turn_whole']:.2f} | "
                     f"x{r['turn_whole'] / r['turn_kept']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    Figure = import_figure()
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    tokens = [r["prompt_tokens"] for r in rows]
    for way, label in (("whole", "prompt read whole"), ("kept", "from the last turn's rows")):
        ax.plot(tokens, [r[f"prefill_{way}"] * 1e3 for r in rows], marker="o", label=label)
    ax.set_xlabel("prompt tokens (the conversation so far)")
    ax.set_ylabel("time to first token, ms")
    ax.legend()
    ax.set_title("A chat's turns through LLM.generate")
    write_png(path, fig)


def run(args: argparse.Namespace, command: str, env: dict) -> None:
    llm = LLM.load(args.ckpt, progress=not args.no_progress)
    print(f"setup: {llm.setup}", flush=True)
    llms = {"kept": llm, "whole": LLM(llm.model, llm.tokenizer, llm.name, llm.generation_defaults, tables=llm.tables)}
    questions = load_prompt_texts(args.data_dir, ["mt_bench"], args.turns)["mt_bench"]
    options = dict(max_new_tokens=args.max_new_tokens, strategy=args.strategy, temperature=0.0)
    rounds = []
    with progress((args.rounds * args.turns + 2) * len(WAYS), "rounds x turns x ways", not args.no_progress) as bar:
        chat_round(llms, questions[:2], 0, dict(options, max_new_tokens=8), bar)  # warm-up
        for r in range(args.rounds):
            rounds.append(chat_round(llms, questions, r, options, bar))
    rows = summary(rounds)
    print(table(rows), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "turns.json", {"command": command, "environment": env, "setup": llm.setup,
                                             "strategy": args.strategy, "max_new_tokens": args.max_new_tokens,
                                             "rounds": rounds, "turns": rows})
    plot(rows, args.out_dir / "turns.png")


def main(argv: Sequence[str] | None = None) -> int:
    return run_timed_job(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
