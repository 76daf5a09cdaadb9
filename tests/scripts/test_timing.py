"""scripts/bench/timing.py: the timed loop's order and seeds, and the medians and paired ratios of its records."""

from __future__ import annotations

import pytest

from scripts.bench.contenders import Contender, Run
from scripts.bench.timing import (
    PromptResult,
    exact_matches,
    group_by_prompt,
    measure,
    paired_ratios,
    paired_speedup,
    sample_seed,
    warm_up,
)


def record(prompt: int, rep: int, wall_s: float, ids: list[int], config: str = "x", decode_s: float | None = None,
           passes: int | None = None) -> dict:
    return dict(dataset="mt_bench", temperature=0.0, config=config, prompt=prompt, rep=rep, wall_s=wall_s,
                decode_s=decode_s, new_tokens=len(ids), forward_passes=passes, token_ids=ids, ids_sha1=str(ids))


def test_a_prompt_keeps_the_median_of_its_repetitions_and_the_first_ones_tokens() -> None:
    records = [record(0, 1, 3.0, [1, 2], decode_s=2.5), record(0, 0, 1.0, [1, 2], decode_s=0.5),
               record(0, 2, 2.0, [1, 2], decode_s=1.5), record(1, 0, 4.0, [5], passes=1), record(1, 1, 6.0, [6])]
    grouped = group_by_prompt(records)
    assert list(grouped) == [("mt_bench", 0.0, "x")]
    first, second = grouped[("mt_bench", 0.0, "x")][0], grouped[("mt_bench", 0.0, "x")][1]
    assert (first.wall_s, first.decode_s, first.ids, first.reps_agree) == (2.0, 1.5, [1, 2], True)
    assert (second.wall_s, second.decode_s, second.ids, second.forward_passes) == (5.0, None, [5], 1)
    assert second.reps_agree is False  # repetition 1 produced other tokens


def result(new_tokens: int, wall_s: float, ids: list[int] | None = None) -> PromptResult:
    return PromptResult(new_tokens, None, wall_s, None, ids or [0] * new_tokens, True)


def test_paired_speedup_is_the_median_of_per_prompt_ratios() -> None:
    rows = {0: result(10, 1.0), 1: result(10, 4.0), 2: result(20, 1.0), 3: result(5, 1.0)}
    base = {0: result(10, 2.0), 1: result(10, 2.0), 2: result(10, 1.0)}  # prompt 3 has no pair: left out
    assert paired_speedup(rows, base) == pytest.approx(2.0)  # ratios 2, 0.5, 2 -> median 2, not the mean 1.5
    # tokens/s, not time: a row that stops early is not counted as faster for it
    assert paired_speedup({0: result(5, 1.0)}, {0: result(10, 2.0)}) == pytest.approx(1.0)
    assert paired_speedup(rows, None) is None and paired_speedup(rows, {}) is None
    assert paired_ratios(rows, base) == pytest.approx([2.0, 0.5, 2.0]) and paired_ratios(rows, None) == []


def test_exact_matches_count_prompts_with_identical_tokens() -> None:
    rows = {0: result(2, 1.0, [1, 2]), 1: result(2, 1.0, [1, 3]), 2: result(1, 1.0, [4])}
    base = {0: result(2, 1.0, [1, 2]), 1: result(2, 1.0, [1, 2]), 2: result(2, 1.0, [4, 5])}
    assert exact_matches(rows, base) == 1
    assert exact_matches(rows, None) is None


def test_measure_runs_every_contender_once_a_repetition_in_a_seeded_shuffled_order() -> None:
    contenders = [Contender(label, "minilade") for label in "abcdef"]
    calls = []

    def fake_run(contender: Contender, ids: list[int], budget: int, temperature: float, seed: int) -> Run:
        calls.append((contender.label, tuple(ids), budget, temperature, seed))
        return Run(new_ids=[7] * budget, wall_s=0.5 * len(calls), forward_passes=budget)

    prompts = {"humaneval": [[1, 2, 3], [4]]}
    records = measure(fake_run, prompts, {0.7: contenders}, max_new_tokens=3, repeats=4, seed=1, desc="test",
                      show_progress=False)
    assert len(records) == len(calls) == 2 * 4 * 6
    orders = [tuple(r["config"] for r in records[k:k + 6]) for k in range(0, len(records), 6)]
    assert all(sorted(order) == list("abcdef") for order in orders)  # each repetition: every contender once
    assert len(set(orders)) > 1  # and not always in the same order
    assert [r["prompt"] for r in records] == [0] * 24 + [1] * 24  # prompt by prompt
    assert {c[4] for c in calls if c[1] == (4,)} == {sample_seed(1, "humaneval", 1)}  # one seed a prompt
    assert records[5]["wall_s"] == 3.0 and records[5]["seed"] == sample_seed(1, "humaneval", 0)
    again = measure(fake_run, prompts, {0.7: contenders}, max_new_tokens=3, repeats=4, seed=1, desc="test",
                    show_progress=False)
    assert [r["config"] for r in again] == [r["config"] for r in records]  # the seed fixes the order


def test_warm_up_runs_each_contender_on_the_longest_prompt_with_a_short_budget() -> None:
    calls = []
    warm_up(lambda c, ids, budget, t, seed: calls.append((c.label, ids, budget, t)),
            {0.0: [Contender("a", "minilade")], 0.8: [Contender("b", "minilade")]},
            {"mt_bench": [[1], [1, 2, 3]], "gsm8k": [[4, 5]]}, max_new_tokens=128)
    assert calls == [("a", [1, 2, 3], 16, 0.0), ("b", [1, 2, 3], 16, 0.8)]
