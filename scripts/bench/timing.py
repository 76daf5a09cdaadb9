"""The timed loop that decode and ar share, and what its records reduce to.

Machines are noisy, so every figure is a ratio measured side by side in one run. Each contender is warmed up
first; then, for each prompt, every contender runs in a shuffled (seeded) order, `repeats` times, and each
(prompt, contender) keeps the median wall time. Speedups are medians over prompts of the paired per-prompt ratio
of tokens per second.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .common import DATASETS, progress
from .contenders import Contender, Run

RunOne = Callable[[Contender, list[int], int, float, int], Run]  # (contender, ids, budget, temperature, seed)
Prompts = dict[str, list[list[int]]]  # dataset -> token ids of each prompt
ContendersByTemperature = dict[float, list[Contender]]


def ids_hash(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def sample_seed(base: int, dataset: str, prompt_index: int) -> int:
    """The sampling seed of one prompt, the same for every contender and repetition."""
    return base + 10_000 * list(DATASETS).index(dataset) + prompt_index


def warm_up(run: RunOne, by_temperature: ContendersByTemperature, prompts: Prompts, max_new_tokens: int) -> None:
    """One untimed run of every contender on the longest prompt (allocates caches, fills kernel caches)."""
    longest = max((ids for items in prompts.values() for ids in items), key=len)
    for temperature, contenders in by_temperature.items():
        for contender in contenders:
            run(contender, longest, min(16, max_new_tokens), temperature, 0)


def measure(run: RunOne, prompts: Prompts, by_temperature: ContendersByTemperature, *, max_new_tokens: int,
            repeats: int, seed: int, desc: str, show_progress: bool = True) -> list[dict]:
    """For each prompt and temperature, every contender in a shuffled order, `repeats` times. One record a run."""
    rng = random.Random(seed)
    per_prompt = sum(len(c) for c in by_temperature.values()) * repeats
    records = []
    with progress(per_prompt * sum(len(items) for items in prompts.values()), desc, show_progress) as bar:
        for dataset, items in prompts.items():
            for i, ids in enumerate(items):
                for temperature, contenders in by_temperature.items():
                    prompt_seed = sample_seed(seed, dataset, i)
                    for rep in range(repeats):
                        for contender in rng.sample(contenders, len(contenders)):
                            bar.set_postfix_str(f"{dataset} #{i} {contender.label}", refresh=False)
                            result = run(contender, ids, max_new_tokens, temperature, prompt_seed)
                            records.append(make_record(dataset, i, temperature, contender, rep, len(ids), prompt_seed,
                                                       result))
                            bar.update()
    return records


def make_record(dataset: str, prompt: int, temperature: float, contender: Contender, rep: int, prompt_tokens: int,
                seed: int, run: Run) -> dict:
    return dict(dataset=dataset, prompt=prompt, temperature=temperature, config=contender.label, rep=rep,
                prompt_tokens=prompt_tokens, seed=seed if temperature > 0 else None, new_tokens=len(run.new_ids),
                forward_passes=run.forward_passes, wall_s=run.wall_s, prefill_s=run.prefill_s,
                decode_s=run.decode_s, finish_reason=run.finish_reason, tokens_per_step=run.tokens_per_step,
                ids_sha1=ids_hash(run.new_ids), token_ids=run.new_ids)


@dataclass
class PromptResult:
    """One (prompt, contender): medians over the repetitions; tokens from the first repetition."""

    new_tokens: int
    forward_passes: int | None
    wall_s: float
    decode_s: float | None
    ids: list[int]
    reps_agree: bool  # every repetition produced the same tokens

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s


def prompt_result(reps: list[dict]) -> PromptResult:
    first = min(reps, key=lambda r: r["rep"])
    decode = [r["decode_s"] for r in reps if r["decode_s"] is not None]
    return PromptResult(first["new_tokens"], first["forward_passes"], statistics.median(r["wall_s"] for r in reps),
                        statistics.median(decode) if decode else None, first["token_ids"],
                        len({r["ids_sha1"] for r in reps}) == 1)


def group_by_prompt(records: list[dict]) -> dict[tuple, dict[int, PromptResult]]:
    """(dataset, temperature, config label) -> prompt index -> PromptResult."""
    runs: dict[tuple, dict[int, list[dict]]] = {}
    for r in records:
        runs.setdefault((r["dataset"], r["temperature"], r["config"]), {}).setdefault(r["prompt"], []).append(r)
    return {key: {prompt: prompt_result(reps) for prompt, reps in by_prompt.items()}
            for key, by_prompt in runs.items()}


def paired_ratios(rows: dict[Any, PromptResult], base: dict[Any, PromptResult] | None) -> list[float]:
    """tokens/s(row) / tokens/s(base) for every prompt both ran, which is the time ratio when both emit the same
    tokens (greedy) and stays fair when they do not (sampling, or a library that stops elsewhere)."""
    return [rows[p].tokens_per_s / base[p].tokens_per_s for p in rows if p in base] if base else []


def paired_speedup(rows: dict[Any, PromptResult], base: dict[Any, PromptResult] | None) -> float | None:
    """Median over prompts of paired_ratios (None without a base)."""
    ratios = paired_ratios(rows, base)
    return statistics.median(ratios) if ratios else None


def exact_matches(rows: dict[Any, PromptResult], base: dict[Any, PromptResult] | None) -> int | None:
    """How many prompts gave exactly the base's tokens."""
    if not base:
        return None
    return sum(rows[p].ids == base[p].ids for p in rows if p in base)
