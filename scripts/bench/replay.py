"""Rank draft policies in seconds by replaying them over saved plain-decoding outputs.

    python -m scripts.bench.replay record --ar bench_out/replay/ar.json      # runs the model once (greedy)
    python -m scripts.bench.replay rank --ar bench_out/replay/ar.json        # replays every policy, no model
    python -m scripts.bench.replay live --strategies auto:7,5,7 auto:5,5,5:recycle_topk=8   # confirm

`live` runs strategies on the real model over the saved prompts and reports compression, rows fed per step and
whether every output equals the saved plain output (token counts only, no timing: the decode benchmark times).

Under greedy decoding the tokens a step accepts depend only on the plain-decoding output: a draft path is
accepted up to its first token that differs from what the model really emitted next. So a policy that drafts
from the text alone (suffix drafts, the text's n-gram pool, the auto planner over them) can be replayed exactly
over saved outputs: per prompt, steps of "draft, accept the longest matching path, emit one more token" until the
saved output is used up. The lookahead window cannot be replayed (it needs the model's outputs at other
positions), so replayed compression is what the text sources achieve on their own. auto+history also drafts from
the other saved outputs of the prompt's dataset (a DraftHistory, leave-one-out): drafts across requests.

Reported per dataset and policy: compression (new tokens per forward pass, the prefill counted, as the decode
benchmark counts it), mean rows fed per step, and the estimated speedup over plain decoding, over the whole set and
as the median over prompts of the per-prompt ratio (the decode benchmark's figure), with the step-cost curve given
by --costs (ms per pass for some row counts, interpolated; default: the curve in docs/benchmarks.md,
measured on the project's 2-core machine). With --per-prompt, also every prompt's compression and estimated
speedup, slowest first: which prompts hold a set's median down, and what they would give under another curve (a
flat one, {"1": 1, "128": 1}: rows that cost nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from minilade.decoding import STRATEGIES, Strategy, make_strategy
from minilade.decoding.auto import PRIORS, Auto, best_plan
from minilade.decoding.step_costs import StepCosts
from minilade.drafts.history import DraftHistory
from minilade.drafts.sources import history_paths, leading_matches, replay_calibration, text_sources
from minilade.drafts.suffix import SuffixIndex
from minilade.drafts.tree import Calibration, DraftPath, DraftTree

from . import plots
from .common import (
    JobParser,
    UsageError,
    add_prompt_options,
    command_line,
    encode_prompts,
    environment,
    load_prompt_texts,
    run_job,
    write_json,
)

MODULE = "scripts.bench.replay"
# ms per forward pass by rows fed: the curve of docs/benchmarks.md (SmolLM2-135M float32, 2 cores, 256 context).
DOC_COSTS = {1: 41.11, 2: 41.53, 4: 49.68, 8: 56.60, 12: 63.94, 16: 67.19, 30: 77.39, 32: 83.93, 56: 118.49,
             64: 133.18}
DEFAULT_POLICIES = ["pool:5,7", "suffix:8,1", "suffix:16,1", "suffix:16,4", "suffix+pool:16,4,5,7",
                    "auto:16,4,5,7,56", "auto:16,4,5,7,16", "auto:32,4,5,7,56", "auto+history:16,4,5,7,56"]


# ---- policies --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Policy:
    """A named way of drafting: make(prompt, history) -> a Drafter holding one prompt's drafting state (history:
    earlier answers, which only auto+history drafts from)."""

    name: str
    make: Callable[[Sequence[int], DraftHistory | None], "Drafter"]


class Drafter:
    """One prompt's drafting state: paths(text) -> paths to verify; learn(paths, matches) after the step."""

    def paths(self, text: Sequence[int]) -> list[DraftPath]:
        raise NotImplementedError

    def learn(self, paths: list[DraftPath], matches: list[int]) -> None:
        pass


class TextDrafter(Drafter):
    """Every path of the text sources, unscored (lookahead's options without the window)."""

    def __init__(self, ngram: int, guesses: int, suffix: int, branches: int) -> None:
        self.paths_for = text_sources(ngram, guesses, suffix, branches)

    def paths(self, text: Sequence[int]) -> list[DraftPath]:
        return self.paths_for(text)


class PlannedDrafter(Drafter):
    """The auto planner without the window: calibrated chances, b chosen under the cost curve and budget."""

    def __init__(self, prompt: Sequence[int], ngram: int, guesses: int, suffix: int, branches: int, budget: int,
                 costs: StepCosts, history: DraftHistory | None = None) -> None:
        self.costs, self.budget, self.calibration = costs, budget, Calibration(PRIORS)
        self.history, self.suffix, self.branches = history, suffix, branches
        index = SuffixIndex()
        start = max(0, len(prompt) - 384)
        index.update(prompt[:start])
        self.paths_for = text_sources(ngram, guesses, suffix, branches, index)
        replay_calibration(self.calibration, prompt, start, self.paths_for)

    def paths(self, text: Sequence[int]) -> list[DraftPath]:
        paths = self.paths_for(text)
        if self.history is not None:
            paths += history_paths(self.history, text, self.suffix, self.branches)
        tree = DraftTree.merge(paths, self.calibration)
        ranked = tree.ranked()
        _, b, _ = best_plan([tree.chance[i] for i in ranked], self.costs, self.budget)
        return tree.paths(ranked[:b])

    def learn(self, paths: list[DraftPath], matches: list[int]) -> None:
        self.calibration.learn(paths, matches)


def parse_policy(text: str, costs: StepCosts) -> Policy:
    """pool:N,G | suffix:L,B | suffix+pool:L,B,N,G | auto:L,B,N,G,BUDGET | auto+history:L,B,N,G,BUDGET (auto
    also drafting from the other saved outputs of the prompt's dataset: a DraftHistory, leave-one-out)."""
    kind, _, params = text.partition(":")
    try:
        nums = [int(x) for x in params.split(",")] if params else []
    except ValueError:
        raise UsageError(f"bad policy {text!r}: parameters must be whole numbers") from None
    shapes = {"pool": 2, "suffix": 2, "suffix+pool": 4, "auto": 5, "auto+history": 5}
    if kind not in shapes or len(nums) != shapes[kind] or min(nums) < 1:
        raise UsageError(f"bad policy {text!r}: expected pool:N,G, suffix:L,B, suffix+pool:L,B,N,G, "
                         f"auto:L,B,N,G,BUDGET or auto+history:L,B,N,G,BUDGET with whole numbers >= 1")
    if kind == "pool":
        n, g = nums
        return Policy(text, lambda prompt, history: TextDrafter(n, g, 0, 1))
    if kind == "suffix":
        length, branches = nums
        return Policy(text, lambda prompt, history: TextDrafter(2, 0, length, branches))
    if kind == "suffix+pool":
        length, branches, n, g = nums
        return Policy(text, lambda prompt, history: TextDrafter(n, g, length, branches))
    length, branches, n, g, budget = nums
    with_history = kind == "auto+history"
    return Policy(text, lambda prompt, history: PlannedDrafter(prompt, n, g, length, branches, budget, costs,
                                                               history if with_history else None))


def other_outputs(records: Sequence[dict], record: dict) -> DraftHistory:
    """A frozen history of the saved outputs of record's dataset other than its own (a server that answered them)."""
    history = DraftHistory()
    for r in records:
        if r["dataset"] == record["dataset"] and r is not record:
            history.add(r["output"])
    history.frozen = True
    return history


# ---- the replay ------------------------------------------------------------------------------------------------

@dataclass
class Replayed:
    new_tokens: int = 0
    passes: int = 0      # the prefill included
    rows: int = 0        # fed by the decoding steps
    cost_ms: float = 0.0  # estimated, decoding steps only

    def add(self, other: "Replayed") -> None:
        self.new_tokens += other.new_tokens
        self.passes += other.passes
        self.rows += other.rows
        self.cost_ms += other.cost_ms


def replay(drafter: Drafter, prompt: Sequence[int], output: Sequence[int], costs: StepCosts) -> Replayed:
    """Greedy decoding replayed: the prefill emits output[0]; each step feeds x and the trie of the drafter's
    paths, accepts the longest prefix equal to the output and emits one more token."""
    text = list(prompt) + list(output[:1])
    done = Replayed(new_tokens=len(output), passes=1)
    while len(text) < len(prompt) + len(output):
        truth = output[len(text) - len(prompt):]
        paths = [p for p in drafter.paths(text) if p.tokens]
        matches = leading_matches(paths, truth)
        accepted = min(max(matches, default=0), len(truth) - 1)
        rows = 1 + trie_rows(paths)
        done.passes += 1
        done.rows += rows
        done.cost_ms += costs(rows)
        drafter.learn(paths, matches)
        text += truth[:accepted + 1]
    return done


def trie_rows(paths: Sequence[DraftPath]) -> int:
    return len({p.tokens[:i + 1] for p in paths for i in range(len(p.tokens))})


# ---- jobs ------------------------------------------------------------------------------------------------------

def record(args: argparse.Namespace, command: str) -> int:
    """Plain greedy decoding of every prompt on the real model; writes prompts and outputs."""
    from minilade import LLM, Autoregressive

    llm = LLM.load(args.ckpt, dtype="float32", compile=False)
    prompts = encode_prompts(llm, load_prompt_texts(args.data_dir, args.datasets, args.n_prompts),
                             show_progress=not args.no_progress)
    records = []
    for name, items in prompts.items():
        for i, ids in enumerate(items):
            out = llm.generate(ids, max_new_tokens=args.max_new_tokens, strategy=Autoregressive())
            records.append(dict(dataset=name, index=i, prompt=ids, output=out.token_ids))
            if not args.no_progress:
                print(f"{name} {i}: {len(out.token_ids)} tokens", file=sys.stderr)
    write_json(args.ar, dict(command=command, environment=environment(), records=records))
    print(f"wrote {args.ar}", file=sys.stderr)
    return 0


def rank(args: argparse.Namespace, command: str) -> int:
    records = load_records(args.ar)
    costs = StepCosts(load_costs(args.costs))
    policies = [parse_policy(p, costs) for p in args.policies]
    print(f"command: {command}\nreplayed greedy steps over {len(records)} saved outputs; no model run\n")
    print("| dataset | policy | compression | rows fed/step | est. speedup vs AR: whole set | median prompt |\n"
          "| --- | --- | --- | --- | --- | --- |")
    results = []
    for name in dict.fromkeys(r["dataset"] for r in records):
        mine = [r for r in records if r["dataset"] == name]
        ar_ms = [costs(1) * (len(r["output"]) - 1) for r in mine]
        for policy in policies:
            total, prompts = Replayed(), []
            for r, ar in zip(mine, ar_ms):
                done = replay(policy.make(r["prompt"], other_outputs(mine, r)), r["prompt"], r["output"], costs)
                total.add(done)
                prompts.append(dict(index=r["index"], new_tokens=done.new_tokens,
                                    compression=done.new_tokens / done.passes,
                                    speedup=ar / done.cost_ms if done.cost_ms else 1.0))
            steps = total.passes - 1
            row = dict(dataset=name, policy=policy.name, compression=total.new_tokens / total.passes,
                       rows_per_step=total.rows / max(steps, 1), speedup=sum(ar_ms) / max(total.cost_ms, 1e-9),
                       median_speedup=statistics.median(p["speedup"] for p in prompts), prompts=prompts)
            results.append(row)
            print(f"| {name} | {policy.name} | {row['compression']:.2f} | {row['rows_per_step']:.1f} | "
                  f"{row['speedup']:.2f} | {row['median_speedup']:.2f} |", flush=True)
    if args.per_prompt:
        print_per_prompt(results)
    write_outputs(args, command, results, "policy", "replayed draft policies (greedy, text sources only)")
    return 0


def print_per_prompt(results: list[dict]) -> None:
    """Every prompt's replayed compression and estimated speedup, each dataset's and policy's prompts from the
    slowest up (the median prompt sits in the middle: where a set's median comes from)."""
    print("\n| dataset | policy | prompt | new tokens | compression | est. speedup vs AR |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for row in results:
        for p in sorted(row["prompts"], key=lambda p: p["speedup"]):
            print(f"| {row['dataset']} | {row['policy']} | {p['index']} | {p['new_tokens']} | "
                  f"{p['compression']:.2f} | {p['speedup']:.2f} |")


def write_outputs(args: argparse.Namespace, command: str, results: list[dict], label_key: str, title: str) -> None:
    """The table as JSON (--out) and as a bar chart (--plot)."""
    if args.out:
        write_json(args.out, dict(command=command, results=results), indent=1)
    if args.plot:
        plots.plot_draft_ablation(plots.import_figure(), results, label_key, title, args.plot)


def parse_strategy(text: str) -> Strategy:
    """NAME:W,N,G[:field=value,...], e.g. auto:5,5,5:suffix_draft=16,recycle_topk=2."""
    name, _, rest = text.partition(":")
    shape, _, extra = rest.partition(":")
    try:
        fields = dict(zip(("window", "ngram", "guesses"), (int(x) for x in shape.split(",")))) if shape else {}
        for item in filter(None, extra.split(",")):
            key, _, value = item.partition("=")
            fields[key] = int(value)
        known = getattr(STRATEGIES.get(name), "__dataclass_fields__", {})
        unknown = [k for k in fields if k not in known]
        if unknown and name in STRATEGIES:
            raise ValueError(f"{name} has no setting {unknown[0]!r}")
        return make_strategy(name, **fields)
    except ValueError as e:
        raise UsageError(f"bad strategy {text!r}: {e}") from None


def live(args: argparse.Namespace, command: str) -> int:
    """Strategies on the real model over the saved prompts: compression and exactness against the saved outputs."""
    from minilade import LLM

    records = load_records(args.ar)
    costs = None if args.costs is None else StepCosts(load_costs(args.costs))
    strategies = [with_costs(parse_strategy(s), costs) for s in args.strategies]
    llm = LLM.load(args.ckpt, dtype="float32", compile=False)
    print(f"command: {command}\n\n| dataset | strategy | compression | rows fed/step | exact |\n"
          "| --- | --- | --- | --- | --- |")
    results = []
    for name in [d for d in dict.fromkeys(r["dataset"] for r in records) if d in args.datasets]:
        mine = [r for r in records if r["dataset"] == name][:args.n_prompts]
        for text, strategy in zip(args.strategies, strategies):
            new = passes = fed = steps = exact = 0
            for r in mine:
                out = llm.generate(r["prompt"], max_new_tokens=len(r["output"]), strategy=strategy)
                s = out.stats
                new, passes, fed, steps = new + s.new_tokens, passes + s.forward_passes, fed + s.tokens_fed, \
                    steps + s.steps
                exact += out.token_ids == r["output"]
            row = dict(dataset=name, strategy=text, compression=new / passes, rows_per_step=fed / max(steps, 1),
                       exact=f"{exact}/{len(mine)}")
            results.append(row)
            print(f"| {name} | {text} | {row['compression']:.2f} | {row['rows_per_step']:.1f} | {row['exact']} |",
                  flush=True)
    write_outputs(args, command, results, "strategy", "live on the model (greedy, float32)")
    return 0


def with_costs(strategy: Strategy, costs: StepCosts | None) -> Strategy:
    """An Auto strategy planning with the given step costs instead of measured ones (a flat curve, {1: 1, 128: 1},
    makes it feed its whole budget: the compression a device where rows are free would get); others unchanged."""
    if costs is None or not isinstance(strategy, Auto):
        return strategy
    return dataclasses.replace(strategy, costs=costs)


def load_records(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["records"]
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot read saved outputs {path}: {e}") from None


def load_costs(path: Path | None) -> dict[int, float]:
    """Step costs {rows: seconds or ms} from a JSON object, or the documented curve."""
    if path is None:
        return dict(DOC_COSTS)
    try:
        return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError) as e:
        raise UsageError(f"cannot read step costs {path}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = JobParser(MODULE, __doc__)
    p.add_argument("job", choices=["record", "rank", "live"],
                   help="record: save plain greedy outputs of the prompt sets (runs the model); "
                        "rank: replay draft policies over saved outputs (no model); "
                        "live: run strategies on the model over the saved prompts (compression, exactness)")
    add_prompt_options(p, n_prompts=20)
    p.add_argument("--ar", type=Path, default=Path("bench_out/replay/ar.json"), help="saved outputs (record's --out)")
    p.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES,
                   help="rank: pool:N,G | suffix:L,B | suffix+pool:L,B,N,G | auto:L,B,N,G,BUDGET")
    p.add_argument("--costs", type=Path, default=None,
                   help="rank: JSON {rows: cost per pass} (default: the documented 2-core curve); live: the "
                        "curve auto plans with instead of measuring it")
    p.add_argument("--strategies", nargs="+", default=["auto:7,5,7"],
                   help="live: NAME:W,N,G[:field=value,...] (fields of the strategy, e.g. suffix_draft=16)")
    p.add_argument("--per-prompt", action="store_true",
                   help="rank: also print every prompt's compression and estimated speedup")
    p.add_argument("--out", type=Path, default=None, help="rank, live: also write the table as JSON")
    p.add_argument("--plot", type=Path, default=None,
                   help="rank, live: also draw the table as a bar chart (PNG; needs matplotlib)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    def job(argv: list[str]) -> int:
        args = build_parser().parse_args(argv)
        command = command_line(MODULE, argv)
        return {"record": record, "rank": rank, "live": live}[args.job](args, command)

    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())

