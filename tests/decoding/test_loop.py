"""The generation loop: settings checked once, the budget and the context's end, and the statistics."""

from __future__ import annotations

import pytest

from minilade.decoding import Autoregressive, GenerationSettings, Lookahead, make_strategy
from minilade.sampling import SamplingParams

from ..helpers import run_tokens, tiny_model


def test_settings_normalise_one_stop_string() -> None:
    assert GenerationSettings(stop="Paris").stop == ("Paris",)
    assert GenerationSettings(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("kwargs,fact", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=1.5), "max_new_tokens must be >= 1"),
    (dict(stop=("",)), "stop strings must be non-empty"),
    (dict(stop=(3,)), "stop strings must be non-empty"),
    (dict(strategy="lookahead"), "strategy must be a Strategy"),
])
def test_bad_settings(kwargs: dict, fact: str) -> None:
    with pytest.raises(ValueError, match=fact):
        GenerationSettings(**kwargs)


def test_make_strategy_takes_the_settings_each_strategy_has() -> None:
    assert make_strategy("autoregressive", window=3, cost_file="x") == Autoregressive()
    assert make_strategy("lookahead", window=3, ngram=3, guesses=2, cost_file="x") == Lookahead(3, 3, 2)
    auto = make_strategy("auto", window=3, ngram=3, guesses=2, cost_file="x", pool_from_prompt=False)
    assert (auto.name, auto.window, auto.cost_file, auto.pool_from_prompt) == ("auto", 3, "x", False)
    with pytest.raises(ValueError, match="unknown strategy 'beam'; choose autoregressive, lookahead, auto"):
        make_strategy("beam")


def test_statistics_add_up() -> None:
    model = tiny_model(vocab=12, seed=1)
    tokens, run = run_tokens(model, [1, 2, 3, 4] * 4, Lookahead(3, 4, 3), max_new_tokens=30)
    stats = run.stats
    assert stats.new_tokens == len(tokens) == 30 and stats.prompt_tokens == 16
    emitted = sum(n * count for n, count in stats.tokens_per_step.items())  # by the steps; the prefill emits one
    assert stats.new_tokens - 1 <= emitted < stats.new_tokens - 1 + 4  # the last step may overshoot the budget
    assert sum(stats.step_kinds.values()) == stats.steps == stats.forward_passes - 1
    assert stats.tokens_fed >= stats.steps and stats.compression == stats.new_tokens / stats.forward_passes


def test_the_budget_and_the_context_end_a_generation() -> None:
    model = tiny_model(vocab=12, seed=1)
    tokens, run = run_tokens(model, [1, 2, 3], Autoregressive(), max_new_tokens=7)
    assert len(tokens) == 7 and run.finish_reason == "length"
    limit = model.config.max_seq_len
    tokens, run = run_tokens(model, [1] * (limit - 5), Autoregressive(), max_new_tokens=50,
                             sampling=SamplingParams(temperature=1.0, seed=0))
    assert len(tokens) == 5 and run.finish_reason == "context"


def test_a_step_larger_than_the_context_is_refused_before_any_allocation() -> None:
    model = tiny_model(vocab=12, seed=1)  # a context of 256 tokens
    with pytest.raises(ValueError, match=r"feeds up to 400004 tokens, more than the model's whole context of 256"):
        run_tokens(model, [1, 2, 3], Lookahead(window=100000, ngram=5, guesses=1))
