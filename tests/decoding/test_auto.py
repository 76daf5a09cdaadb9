"""The automatic strategy: exact output whatever it chooses, and choices that follow costs and acceptance."""

from __future__ import annotations

import json

import pytest
import torch

import minilade.decoding.step_costs as step_costs
from minilade.decoding import Autoregressive
from minilade.decoding.auto import AcceptanceStats, Auto, prompt_self_prediction
from minilade.decoding.step_costs import StepCosts, step_costs_for
from minilade.sampling import SamplingParams

from ..helpers import chi_square_p_value, exact_distribution, run_tokens, sample_counts, tiny_model


def test_step_costs_interpolate_between_measured_sizes() -> None:
    costs = StepCosts({1: 1.0, 4: 2.5, 8: 3.0})
    assert costs(1) == 1.0 and costs(2) == 1.5 and costs(4) == 2.5 and costs(6) == 2.75 and costs(16) == 6.0


def test_acceptance_counterfactuals_from_one_step() -> None:
    stats = AcceptanceStats(guesses=3, cand_len=4, prior_weight=1e-9, decay=1.0)
    stats.observe([1, 3, 0], cand_len=4)  # candidate 1 matched 3 tokens
    assert stats.expected(1, 4) == pytest.approx(1)  # only the first candidate
    assert stats.expected(2, 4) == pytest.approx(3) and stats.expected(3, 4) == pytest.approx(3)
    assert stats.expected(2, 2) == pytest.approx(2)  # candidates cut to 2 tokens
    stats.observe([0], cand_len=4)
    assert stats.expected(1, 4) == pytest.approx(0.5) and stats.expected(2, 4) == pytest.approx(3)


def test_prompt_self_prediction_tells_repetitive_from_random_text() -> None:
    repetitive = [1, 2, 3, 4, 5] * 20
    rng = torch.Generator().manual_seed(0)
    random = torch.randint(0, 1000, (100,), generator=rng).tolist()
    hits = prompt_self_prediction(repetitive, ngram=4, guesses=2)
    assert len(hits) > 80 and all(m == [3] for m in hits[-50:-3])  # the last ones have less text to match
    assert all(m == [0] for m in prompt_self_prediction(random, ngram=4, guesses=2))  # a few repeated tokens


def costs_of(seconds) -> StepCosts:
    """Step costs given by a formula instead of measured (every size a step of these tests can feed)."""
    return StepCosts({T: seconds(T) for T in range(1, 128)})


def test_expensive_steps_mean_plain_decoding() -> None:
    costs = costs_of(lambda T: float(T))  # a step of T tokens costs T: lookahead can never pay
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    expected, _ = run_tokens(model, prompt, Autoregressive())
    got, run = run_tokens(model, prompt, Auto(4, 4, 4, costs=costs))
    assert got == expected
    assert set(run.stats.step_kinds) <= {"single", "verify 1x1"}  # plain steps, and at most a rare cheap probe
    assert run.stats.step_kinds["single"] > 30


def test_free_steps_mean_the_largest_useful_step() -> None:
    costs = costs_of(lambda T: 1.0)  # every step costs the same: take the window and all candidates
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    expected, _ = run_tokens(model, prompt, Autoregressive())
    got, run = run_tokens(model, prompt, Auto(4, 4, 4, costs=costs))
    assert got == expected
    assert sum(v for k, v in run.stats.step_kinds.items() if k.startswith("window+")) > run.stats.steps // 2
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
            kinds |= {k.split()[0].rstrip("+0123456789") for k in run.stats.step_kinds}
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


def test_measure_step_costs_times_each_size_after_a_warm_up(monkeypatch) -> None:
    """Every size is run once to warm up and then `repeats` times, round-robin, after the context prefill, with all
    its rows fed at the positions that follow the context; the median of its timed runs is reported."""
    model = tiny_model(vocab=12, seed=1)
    fed, now = [], [0.0]
    forward = model.forward
    durations = iter([0.1, 5.0, 9.0, 3.0, 2.0, 7.0, 1.0, 8.0, 4.0, 6.0, 11.0, 10.0, 12.0] * 2)

    def recording(tokens, input_pos, cache, mask=None, logits_rows=None):
        fed.append((tokens.shape[1], int(input_pos[0]), cache.length))
        now[0] += next(durations)  # a fake clock that each forward pass advances by a chosen duration
        return forward(tokens, input_pos, cache, mask, logits_rows)

    monkeypatch.setattr(model, "forward", recording)
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: now[0])
    seconds = step_costs.measure_step_costs(model, [8, 1, 3], context=16, repeats=3)
    assert fed[0] == (16, 0, 0)  # the context
    assert fed[1:] == [(T, 16, 16) for _ in range(4) for T in (1, 3, 8)]  # round-robin, warm-up round first
    # Passes after the context took 5, 9, 3 (warm-up), then 2, 7, 1 | 8, 4, 6 | 11, 10, 12 for sizes 1, 3, 8.
    assert seconds == {1: 8.0, 3: 7.0, 8: 6.0}


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


def test_a_file_that_is_not_a_cost_table_is_not_overwritten(tmp_path) -> None:
    model = tiny_model(vocab=12, seed=1)
    precious = tmp_path / "notes.json"
    precious.write_text('["not", "a", "cost", "table"]')
    with pytest.raises(ValueError, match="is not a step-cost table; refusing to overwrite it"):
        step_costs_for(model, [1, 2], precious)
    assert precious.read_text() == '["not", "a", "cost", "table"]'
