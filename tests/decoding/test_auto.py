"""The automatic strategy: exact output whatever it chooses, and choices that follow costs and acceptance."""

from __future__ import annotations

import json

import pytest
import torch

import minilade.decoding.step_costs as step_costs
import minilade.memo as memo
from minilade.decoding import Autoregressive, Lookahead
from minilade.decoding.auto import PRIORS, Auto, AutoDecoder, best_plan
from minilade.decoding.base import StepKind
from minilade.decoding.step_costs import StepCosts, step_costs_for
from minilade.device import make_exact
from minilade.memo import read_table
from minilade.quant import quantize_embedding, quantize_linears
from minilade.sampling import SamplingParams

from ..helpers import (
    FLAT_COSTS,
    checked_runs,
    chi_square_p_value,
    costs_of,
    exact_distribution,
    run_tokens,
    sample_counts,
    tiny_model,
)


def test_step_costs_interpolate_between_measured_sizes() -> None:
    costs = StepCosts({1: 1.0, 4: 2.5, 8: 3.0})
    assert costs(1) == 1.0 and costs(2) == 1.5 and costs(4) == 2.5 and costs(6) == 2.75 and costs(16) == 6.0


def test_a_measured_dip_in_step_costs_is_lifted_to_the_cost_below_it() -> None:
    """A one-row step measured slower than a two-row one (noise): more rows never count as cheaper."""
    costs = StepCosts({1: 2.0, 2: 1.0, 4: 3.0})
    assert costs(1) == costs(2) == 2.0 and costs(3) == 2.5 and costs(4) == 3.0


def test_expensive_steps_mean_plain_decoding() -> None:
    costs = costs_of(lambda T: float(T))  # a step of T tokens costs T: lookahead can never pay
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    expected, _ = run_tokens(model, prompt, Autoregressive())
    got, run = run_tokens(model, prompt, Auto(4, 4, 4, costs=costs))
    assert got == expected
    probe = StepKind(paths=1, depth=1)  # the most likely node alone, a rare cheap probe
    assert set(run.stats.step_kinds) <= {StepKind(), probe}
    assert run.stats.step_kinds[StepKind()] > 30


def test_a_probe_is_taken_only_where_it_costs_little() -> None:
    """After 32 plain steps auto probes the most likely node where a second row is nearly free; where it costs as
    much as the first (a shared compiled pass's wider call), not within 100 steps."""
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    probe = StepKind(paths=1, depth=1)
    cheap = costs_of(lambda T: {1: 1.0, 2: 1.001}.get(T, 10.0 + T))  # no draft pays, but a probe costs little
    for costs, probes in ((cheap, True), (costs_of(lambda T: float(T)), False)):
        got, run = run_tokens(model, prompt, Auto(4, 4, 4, costs=costs), max_new_tokens=100)
        assert set(run.stats.step_kinds) == ({StepKind(), probe} if probes else {StepKind()}), run.stats.step_kinds


def test_after_a_run_of_plain_steps_auto_plans_only_every_few_steps(monkeypatch) -> None:
    """Where no draft pays, the first PLAN_ALWAYS steps are planned, then one in PLAN_EVERY (planning costs the same
    whatever it decides); the output stays plain decoding's."""
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    planned = []
    choose = AutoDecoder.choose
    monkeypatch.setattr(AutoDecoder, "choose", lambda self, tree: planned.append(1) or choose(self, tree))
    expected, _ = run_tokens(model, prompt, Autoregressive())
    got, run = run_tokens(model, prompt, Auto(4, 4, 4, costs=costs_of(lambda T: float(T))))
    assert got == expected and set(run.stats.step_kinds) == {StepKind()}
    steps = run.stats.steps - 1  # after the prefill
    plan_always, plan_every = AutoDecoder.PLAN_ALWAYS, AutoDecoder.PLAN_EVERY
    assert steps > 2 * plan_always
    assert len(planned) == plan_always + len(range(plan_always, steps, plan_every))
    # in a pass of 8 generations, a plan delays 8 for the drafts of one: one in 4 * PLAN_EVERY
    planned.clear()
    got, run = run_tokens(model, prompt, Auto(4, 4, 4, costs=costs_of(lambda T: float(T)), shared=Crowd((7, 7.0), 8)))
    assert got == expected and set(run.stats.step_kinds) == {StepKind()}
    assert len(planned) == plan_always + len(range(plan_always, run.stats.steps - 1, 4 * plan_every))


def test_free_steps_mean_the_largest_useful_step() -> None:
    costs = costs_of(lambda T: 1.0)  # every step costs the same: take the window and all candidates
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    expected, _ = run_tokens(model, prompt, Autoregressive())
    got, run = run_tokens(model, prompt, Auto(4, 4, 4, costs=costs))
    assert got == expected
    assert sum(v for k, v in run.stats.step_kinds.items() if k.window) > run.stats.steps // 2
    assert run.stats.compression > 1.5


@pytest.mark.parametrize("seed", range(3))
def test_auto_greedy_equals_autoregressive_whatever_it_chooses(seed: int) -> None:
    """Costs with a random slope, so every kind of step gets chosen somewhere."""
    slope = [0.02, 0.1, 0.5][seed]
    costs = costs_of(lambda T: 1.0 + slope * T)
    model = tiny_model(vocab=12 + 4 * seed, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    kinds = set()
    for _ in range(4):
        prompt = torch.randint(0, model.config.vocab_size, (int(torch.randint(2, 20, (1,), generator=gen)),),
                               generator=gen).tolist()
        expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=48)
        for settings in [(3, 4, 3), (1, 2, 2), (2, 5, 4)]:
            got, run = run_tokens(model, prompt, Auto(*settings, costs=costs), max_new_tokens=48)
            assert got == expected, (prompt, settings)
            kinds |= {"window" if k.window else "verify" if k.paths else "single" for k in run.stats.step_kinds}
    assert {"single", "verify"} <= kinds


def test_auto_sampling_keeps_the_distribution() -> None:
    model = tiny_model(vocab=6, seed=11, std=0.35)
    params, n = SamplingParams(temperature=1.0), 2000
    counts, accepted_steps = sample_counts(model, Auto(3, 3, 4, costs=costs_of(lambda T: 1.0 + 0.05 * T)), params, n)
    assert accepted_steps > n // 4
    assert chi_square_p_value(counts, exact_distribution(model, params), n) > 1e-3


def test_measured_costs_are_kept_in_the_cost_file(monkeypatch, tmp_path) -> None:
    model = tiny_model(vocab=12, seed=1)
    cost_file = tmp_path / "costs.json"
    costs = step_costs_for(model, [1, 4, 9], cost_file)
    assert costs(4) > 0 and set(next(iter(json.loads(cost_file.read_text()).values()))) == {"1", "4", "9"}
    monkeypatch.setattr(step_costs, "measure_step_costs", lambda *a, **k: pytest.fail("measured again"))
    assert step_costs_for(model, [1, 4, 9]).seconds == costs.seconds  # remembered for this model
    other = tiny_model(vocab=12, seed=1)  # the same shape: the file has its costs
    assert step_costs_for(other, [1, 4, 9], cost_file).seconds == costs.seconds


def test_measure_step_costs_times_steps_as_decoding_runs_them(monkeypatch) -> None:
    """After the context prefill, every size is run once to warm up and then `repeats` times, round-robin, widest
    first, each time after PLAIN_BEFORE plain steps (the plain step PLAIN_SAMPLES times a round): one row as a plain
    step (no mask), more as x and a tree of drafts (masked), at the positions that follow the context, the cache
    rolled back after each step; the median of a size's timed steps is reported."""
    model = tiny_model(vocab=12, seed=1)
    before, plain_samples = step_costs.PLAIN_BEFORE, step_costs.PLAIN_SAMPLES
    schedule = [(T if timed else 1, timed) for _ in range(4) for T in (8, 3, 1)
                for timed in [False] * before + [True] * (plain_samples if T == 1 else 1)]  # (rows, timed)
    # Timed steps take their size's durations below in turn, the warm-up round's first; the others 100.
    durations = {8: iter([5.0, 2.0, 8.0, 11.0]), 3: iter([9.0, 7.0, 4.0, 10.0]),
                 1: iter([3.0] * plain_samples + [1.0, 6.0, 12.0, 2.0, 13.0] + [6.0] * (2 * plain_samples))}
    fed, now = [], [0.0]
    forward = model.forward

    def recording(tokens, input_pos, cache, mask=None, logits_rows=None):
        fed.append((tokens.shape[1], int(input_pos.reshape(-1)[0]), cache.length, mask is not None))
        if len(fed) > 1:  # a fake clock that each step's forward advances
            T, timed = schedule[len(fed) - 2]
            now[0] += next(durations[T]) if timed else 100.0
        return forward(tokens, input_pos, cache, mask, logits_rows)

    monkeypatch.setattr(model, "forward", recording)
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: now[0])
    seconds = step_costs.measure_step_costs(model, [8, 1, 3], context=16, repeats=3)
    assert fed[0] == (16, 0, 0, False)  # the context
    assert fed[1:] == [(T, 16, 16, T > 1) for T, _ in schedule]
    # Timed after the warm-up round: 8: 2, 8, 11; 3: 7, 4, 10; 1: 1, 6, 12, 2, 13 and ten 6s.
    assert seconds == {8: 8.0, 3: 7.0, 1: 6.0}


def test_a_cost_file_with_bad_entries_is_measured_again(monkeypatch, tmp_path) -> None:
    model = tiny_model(vocab=12, seed=1)
    key = step_costs.cost_key(model)
    cost_file = tmp_path / "costs.json"
    cost_file.write_text(json.dumps({key: {"1": None, "4": 0, "9": "fast", "x": 1.0, "16": 0.5}}))
    measured = []
    monkeypatch.setattr(step_costs, "measure_step_costs",
                        lambda model, sizes, **kw: measured.extend(sizes) or {T: 0.01 * T for T in sizes})
    costs = step_costs_for(model, [1, 4, 9, 16], cost_file)
    assert sorted(measured) == [1, 4, 9] and costs(16) == 0.5 and costs(4) == 0.04


def test_an_implausible_step_cost_table_is_measured_again_before_it_is_kept(monkeypatch, tmp_path) -> None:
    """A measured table in which a step costs more than PLAUSIBLE_DIP times a wider one (measured while something
    else ran) is measured again, all of it, once, and the second measurement kept. A kept table is used as it is,
    whatever its figures: every process that reads the file must plan alike (a seeded sampled answer depends on it)."""
    model = tiny_model(vocab=12, seed=1)
    key = step_costs.cost_key(model)
    cost_file = tmp_path / "costs.json"
    cost_file.write_text(json.dumps({key: {"1": 0.0128, "2": 0.0528}}))  # kept, noisy, without 3 and 4
    tables = iter([{1: 0.004, 3: 0.005, 4: 0.006}, {1: 0.004, 2: 0.005, 3: 0.0055, 4: 0.006}])
    measured = []
    monkeypatch.setattr(step_costs, "measure_step_costs",
                        lambda model, sizes, **kw: measured.append(sorted(sizes)) or next(tables))
    costs = step_costs_for(model, [1, 2, 3, 4], cost_file)
    assert measured == [[1, 3, 4], [1, 2, 3, 4]]  # the missing sizes; then all of it, the table being implausible
    assert [costs(T) for T in (1, 2, 3, 4)] == [0.004, 0.005, 0.0055, 0.006]
    assert json.loads(cost_file.read_text())[key] == {"1": 0.004, "2": 0.005, "3": 0.0055, "4": 0.006}
    assert step_costs.plausible({1: 5.48, 2: 5.23, 4: 5.74}) and not step_costs.plausible({1: 4.0, 2: 9.0, 3: 5.0})

    noisy = {"1": 0.0128, "2": 0.0528, "3": 0.0158, "4": 0.0151}
    cost_file.write_text(json.dumps({key: noisy}))
    step_costs._MEASURED.clear()  # another process
    costs = step_costs_for(model, [1, 2, 3, 4], cost_file)
    assert len(measured) == 2 and (costs(1), costs(2)) == (0.0128, 0.0528)  # not measured again


def test_kept_step_costs_and_verdicts_belong_to_one_processor(monkeypatch, tmp_path) -> None:
    """A weights folder outlives its machine (and a virtual machine moves between CPU models): figures measured on
    a processor with other SIMD units, which runs other kernels, must be measured again, not reused."""
    model = tiny_model(vocab=12, seed=1)
    monkeypatch.setattr(memo, "cpu_fields", lambda: {"model name": "AMD EPYC", "flags": "fpu sse2 avx avx2 fma"})
    zen3 = step_costs.cost_key(model)
    assert "cpu AMD EPYC [avx avx2]" in zen3
    cost_file = tmp_path / "costs.json"
    cost_file.write_text(json.dumps({zen3: {"1": 0.01, "4": 0.02}}))
    monkeypatch.setattr(memo, "cpu_fields", lambda: {"model name": "AMD EPYC", "flags": "avx avx2 avx512f avx512_bf16"})
    assert step_costs.cost_key(model) != zen3
    measured = []
    monkeypatch.setattr(step_costs, "measure_step_costs",
                        lambda model, sizes, **kw: measured.extend(sizes) or {T: 0.5 * T for T in sizes})
    assert step_costs_for(model, [1, 4], cost_file)(4) == 2.0 and sorted(measured) == [1, 4]
    monkeypatch.setattr(memo, "cpu_fields", dict)  # no /proc/cpuinfo: still a key, never a crash
    assert "cpu " in step_costs.cost_key(model)


def test_a_quantized_model_keeps_its_own_step_costs_and_invariance_verdict(monkeypatch, tmp_path) -> None:
    """Quantized steps cost differently from float steps of the same model (and run other kernels), so a float model's
    kept figures must not serve the quantized one."""
    model = tiny_model(vocab=12, seed=1)
    cost_file, check_file = tmp_path / "costs.json", tmp_path / "invariance.json"
    cost_file.write_text(json.dumps({step_costs.cost_key(model): {"1": 0.01, "4": 0.02}}))
    make_exact(model, check_file)
    quantized = quantize_embedding(quantize_linears(model, "int8"), group_size=16)
    key = step_costs.cost_key(quantized)
    assert "(embedding int8 g16, int8 bfloat16)" in key and key not in read_table(check_file)
    measured = []
    monkeypatch.setattr(step_costs, "measure_step_costs",
                        lambda model, sizes, **kw: measured.extend(sizes) or {T: 0.5 * T for T in sizes})
    assert step_costs_for(quantized, [1, 4], cost_file)(4) == 2.0 and sorted(measured) == [1, 4]
    assert make_exact(quantized, check_file).exact and key in read_table(check_file)  # checked, then kept


def test_a_file_that_is_not_a_cost_table_is_not_overwritten(tmp_path) -> None:
    model = tiny_model(vocab=12, seed=1)
    precious = tmp_path / "notes.json"
    precious.write_text('["not", "a", "cost", "table"]')
    with pytest.raises(ValueError, match="is not a step-cost table; refusing to overwrite it"):
        step_costs_for(model, [1, 2], precious)
    assert precious.read_text() == '["not", "a", "cost", "table"]'


def test_best_plan_feeds_nodes_while_they_pay() -> None:
    chances = [0.9, 0.8, 0.5, 0.1, 0.01]
    flat = costs_of(lambda T: 1.0)
    assert best_plan(chances, flat, budget=64) == (False, 5, pytest.approx(1 + 2.31))  # free rows: feed them all
    assert best_plan(chances, flat, budget=3)[:2] == (False, 2)  # x and two nodes fill a budget of 3 rows
    linear = costs_of(lambda T: float(T))  # a row costs as much as a step: only a node surer than 1 would pay
    assert best_plan(chances, linear, budget=64)[:2] == (False, 0)
    # 1 + 0.2 T: the n-th node pays while its chance exceeds 0.2 x the expected tokens per cost so far.
    assert best_plan(chances, costs_of(lambda T: 1.0 + 0.2 * T), budget=64)[:2] == (False, 3)


def test_best_plan_runs_the_window_only_when_its_gain_pays_for_its_rows() -> None:
    costs = costs_of(lambda T: 1.0 + 0.05 * T)
    assert best_plan([0.5], costs, budget=64, window_rows=12, window_gain=0.1)[:2] == (False, 1)
    assert best_plan([0.5], costs, budget=64, window_rows=12, window_gain=2.0)[:2] == (True, 1)
    assert best_plan([0.5], costs, budget=11, window_rows=12, window_gain=2.0)[:2] == (False, 1)  # over budget


def test_auto_near_the_end_of_the_context_stays_exact() -> None:
    model = tiny_model(vocab=12, seed=2)
    limit = model.config.max_seq_len
    prompt = ([1, 2, 3] * 200)[:limit - 30]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=50)
    got, run = run_tokens(model, prompt, Auto(3, 4, 3, costs=costs_of(lambda T: 1.0)), max_new_tokens=50)
    assert got == expected and run.finish_reason == "context" and run.stats.steps < 29


@pytest.mark.parametrize("field,value", [("draft_budget", 0), ("draft_budget", 1.5), ("suffix_draft", -2)])
def test_invalid_auto_settings(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"{field} .*must be a whole number"):
        Auto(**{field: value})


def test_the_draft_budget_bounds_every_step() -> None:
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=48)
    strategy = Auto(2, 3, 2, draft_budget=5, costs=costs_of(lambda T: 1.0))
    assert strategy.max_step_tokens() == 5
    got, run = run_tokens(model, prompt, strategy, max_new_tokens=48)
    assert got == expected and run.stats.tokens_fed <= 5 * run.stats.steps
    assert max(run.stats.tokens_per_step) == 5  # x and four drafted tokens, all accepted, and the bonus token


def test_step_costs_on_a_short_context_use_only_its_positions(monkeypatch) -> None:
    """A 32-token model measured at 1 and 32 tokens (the load-time dtype check does this): no negative or
    out-of-context position (they wrapped around the rotary table silently before it was checked)."""
    from minilade.config import ModelConfig
    from minilade.model import Transformer
    model = Transformer(ModelConfig.preset("tiny-mha").replace(max_seq_len=32)).init_random()
    seen, forward = [], Transformer.forward

    def spy(self, tokens, input_pos, *args, **kwargs):
        seen.append((int(input_pos.min()), int(input_pos.max())))
        return forward(self, tokens, input_pos, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    assert set(step_costs.measure_step_costs(model, (1, 32, 40), context=128, repeats=1)) == {1, 32, 40}
    assert seen and all(0 <= low <= high < 32 for low, high in seen)


# ---- draft sources: suffix drafts (ragged paths of any length) and recycled top-k -----------------------------------

SUFFIX_SETTINGS = [dict(window=1, ngram=2, guesses=0, suffix_draft=6, suffix_branches=1, draft_budget=16),
                   dict(window=3, ngram=3, guesses=2, suffix_draft=9, suffix_branches=3, draft_budget=24),
                   dict(window=4, ngram=4, guesses=4, suffix_draft=1, suffix_branches=2)]


@pytest.mark.parametrize("model_seed", range(3))
def test_greedy_with_suffix_drafts_equals_autoregressive(model_seed: int) -> None:
    model = tiny_model(vocab=8 + 4 * model_seed, seed=model_seed)
    runs = checked_runs(model, 200 + model_seed, [Auto(**s, costs=FLAT_COSTS) for s in SUFFIX_SETTINGS])
    assert any(max(run.stats.tokens_per_step) > s.ngram for s, run in runs), \
        "no step emitted more than N tokens: suffix drafts were never accepted past N - 1"


def test_suffix_drafts_near_the_end_of_the_context_never_overrun_it() -> None:
    model = tiny_model(vocab=12, seed=2)
    limit = model.config.max_seq_len
    prompt = ([1, 2, 3] * 200)[:limit - 30]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=50)
    strategy = Auto(1, 2, 0, suffix_draft=64, suffix_branches=2, draft_budget=128, costs=FLAT_COSTS)  # drafts far
    got, run = run_tokens(model, prompt, strategy, max_new_tokens=50)  # longer than the room left
    assert got == expected and len(got) == 30 and run.finish_reason == "context"
    assert run.stats.steps < 29  # drafts were accepted, cut to the room left


@pytest.mark.parametrize("field,value,message", [
    ("suffix_draft", -1, "suffix_draft .* must be a whole number >= 0"),
    ("suffix_draft", 2.5, "suffix_draft .* must be a whole number >= 0"),
    ("suffix_branches", 0, "suffix_branches .* must be a whole number >= 1"),
    ("suffix_branches", True, "suffix_branches .* must be a whole number >= 1"),
    ("recycle_topk", -1, "recycle_topk .* must be a whole number >= 0"),
])
def test_invalid_draft_settings(field: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Auto(**{field: value})


@pytest.mark.parametrize("model_seed", range(2))
def test_greedy_with_recycled_drafts_equals_autoregressive(model_seed: int) -> None:
    model = tiny_model(vocab=10 + 4 * model_seed, seed=model_seed)
    strategies = [Auto(1, 3, 0, suffix_draft=0, recycle_topk=3, draft_budget=16, costs=FLAT_COSTS),
                  Auto(3, 4, 2, recycle_topk=2, suffix_draft=5, costs=FLAT_COSTS)]
    runs = checked_runs(model, 300 + model_seed, strategies, max_new_tokens=40)
    recycled_only = [run for s, run in runs if not s.suffix_draft]
    assert any(run.stats.forward_passes < run.stats.new_tokens for run in recycled_only)


def test_best_plan_for_a_shared_pass_weighs_every_row_in_it() -> None:
    """Other generations' rows make the pass dearer and their tokens are its worth too: fewer drafts pay, down to
    none; where rows are free, a crowd changes nothing."""
    chances = [0.9, 0.8, 0.5, 0.1, 0.01]
    costs = costs_of(lambda T: 1.0 + 0.2 * T)
    assert best_plan(chances, costs, budget=64, other_tokens=0.0)[:2] == (False, 3)  # as alone
    assert best_plan(chances, lambda rows: costs(7 + rows), budget=64, other_tokens=7.0)[:2] == (False, 2)
    assert best_plan(chances, lambda rows: costs(60 + rows), budget=64, other_tokens=60.0)[:2] == (False, 0)
    assert best_plan(chances, lambda rows: 1.0, budget=64, other_tokens=60.0)[:2] == (False, 5)
    # a plan that pays against the others as they are, but not against every generation plain: no drafts
    drafted = (1 + 0.9 + 0.8 + 0.5) / costs(4)
    assert best_plan(chances, costs, budget=64, all_plain=drafted * 0.99)[:2] == (False, 3)
    assert best_plan(chances, costs, budget=64, all_plain=drafted)[:2] == (False, 0)


class Crowd:
    """Passes shared with other generations feeding (rows, tokens), all rows in one step; keeps the rows each plan
    told."""

    def __init__(self, others: tuple[int, float], generations: int = 2) -> None:
        self.fed, self.plans, self.n = others, [], generations

    def others(self, costs):
        rows, tokens = self.fed
        return (lambda mine: costs(rows + mine)), tokens, 0.0

    def plan(self, rows: int, expected: float) -> None:
        self.plans.append(rows)

    def generations(self) -> int:
        return self.n


def test_auto_in_a_crowded_pass_feeds_fewer_rows_tells_each_plan_and_stays_exact() -> None:
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=48)
    costs = costs_of(lambda T: 1.0 + 0.2 * T)
    alone_tokens, alone = run_tokens(model, prompt, Auto(2, 3, 2, costs=costs), max_new_tokens=48)
    crowd = Crowd((600, 600.0))
    got, run = run_tokens(model, prompt, Auto(2, 3, 2, costs=costs, shared=crowd), max_new_tokens=48)
    assert got == alone_tokens == expected
    assert len(crowd.plans) == run.stats.steps and sum(crowd.plans) == run.stats.tokens_fed
    assert run.stats.tokens_fed < alone.stats.tokens_fed


@pytest.mark.parametrize("strategy", [Auto(2, 3, 2, costs=costs_of(lambda T: 1.0)), Lookahead(2, 3, 2)],
                         ids=["auto", "lookahead"])
def test_steps_count_drafts_fed_and_accepted_by_source(strategy) -> None:
    model = tiny_model(vocab=12, seed=1)
    _, run = run_tokens(model, [1, 2, 3, 4] * 6, strategy, max_new_tokens=48)
    stats = run.stats
    assert sum(stats.drafts_fed.values()) == stats.tokens_fed - stats.steps
    accepted = sum((n - 1) * steps for n, steps in stats.tokens_per_step.items())
    assert sum(stats.drafts_accepted.values()) == accepted > 0
    assert {s for s, n in stats.drafts_accepted.items() if n} <= set(stats.drafts_fed) <= set(PRIORS)
