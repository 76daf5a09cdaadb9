"""The generation loop: settings checked once, the budget and the context's end, and the statistics."""

from __future__ import annotations

import pytest

from minilade.decoding import Auto, Autoregressive, GenerationSettings, Lookahead, make_strategy
from minilade.sampling import SamplingParams

from ..helpers import FLAT_COSTS, run_tokens, tiny_model


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
    with pytest.raises(ValueError, match=r"feeds up to 300015 tokens, more than the model's whole context of 256"):
        run_tokens(model, [1, 2, 3], Lookahead(window=5, ngram=4, guesses=100000))


def short_context_model(context: int = 32):
    from minilade.config import ModelConfig
    from minilade.invariance import apply_exact_attention
    from minilade.model import Transformer
    config = ModelConfig.preset("tiny-gqa").replace(vocab_size=12, max_seq_len=context)
    return apply_exact_attention(Transformer(config).init_random(seed=3, std=0.3).eval())


def spy_positions(model, monkeypatch) -> list[tuple[int, int, int]]:
    """Record (highest rotary position, rows fed, cache slots left) of every forward pass."""
    seen, forward = [], type(model).forward

    def spy(self, tokens, input_pos, cache, *args, **kwargs):
        seen.append((int(input_pos.max()), tokens.shape[1], cache.capacity - cache.length))
        return forward(self, tokens, input_pos, cache, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    return seen


@pytest.mark.parametrize("window", [12, 100000])
def test_auto_fits_its_steps_to_a_tiny_context(window: int, monkeypatch) -> None:
    """`--strategy auto -W 12` on a 32-token context shrinks its steps (no cache-capacity error),
    and its output is plain decoding's up to the context's end; -W 100000 shrinks too, allocating nothing large."""
    model = short_context_model()
    prompt = [1, 2, 3, 1, 2]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=60)
    seen = spy_positions(model, monkeypatch)
    got, run = run_tokens(model, prompt, Auto(window=window, costs=FLAT_COSTS), max_new_tokens=60)
    assert got == expected and run.finish_reason == "context" and len(got) == 32 - len(prompt)
    assert all(high < 32 and rows <= left for high, rows, left in seen)
    assert max(rows for _, rows, _ in seen) > 1  # it did take lookahead steps, within 32 - 5 rows
    assert max(rows for _, rows, _ in seen[1:]) <= 32 - len(prompt)


def test_lookahead_whose_step_cannot_fit_the_context_is_one_line_naming_the_options() -> None:
    model = short_context_model()
    with pytest.raises(ValueError, match=r"lookahead\(W=12, N=4, G=5\) feeds up to 51 tokens, more than the "
                                         r"model's whole context of 32; choose a smaller window \(-W\), .* or "
                                         r"strategy auto, which fits its steps"):
        run_tokens(model, [1, 2, 3], Lookahead(window=12))


@pytest.mark.parametrize("strategy", [
    Lookahead(3, 4, 3), "auto", "auto-recycle"])
def test_drafts_near_the_end_of_the_context_never_overrun_it(strategy, monkeypatch) -> None:
    """Every draft and window row stays at a position inside the context and every step inside the cache, while
    the output stays plain decoding's to the last position."""
    if isinstance(strategy, str):
        strategy = Auto(3, 4, 3, recycle_topk=2 if strategy == "auto-recycle" else 0, costs=FLAT_COSTS)
    model = short_context_model(48)
    prompt = [1, 2, 3, 4] * 4
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=100)
    seen = spy_positions(model, monkeypatch)
    got, run = run_tokens(model, prompt, strategy, max_new_tokens=100)
    assert got == expected and run.finish_reason == "context" and len(got) == 48 - len(prompt)
    assert all(high < 48 and rows <= left for high, rows, left in seen)
