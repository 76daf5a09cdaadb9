"""Lookahead decoding: exact equality with autoregressive output, budgets, EOS, the context's end."""

from __future__ import annotations

import itertools

import pytest
import torch

from minilade.decoding import Autoregressive, Lookahead
from minilade.masks import LookaheadLayout

from ..helpers import run_tokens, tiny_model


def test_shared_prefixes_feed_fewer_tokens_with_the_same_output() -> None:
    model = tiny_model(vocab=8, seed=3)  # a tiny vocabulary: many candidates share their first tokens
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=40)
    got, run = run_tokens(model, prompt, Lookahead(3, 4, 6), max_new_tokens=40)
    assert got == expected
    window_rows = LookaheadLayout(3, 4, 6).n_window_rows
    flat = sum(n * (window_rows + 3 * int(kind.split("+")[1].split("x")[0]))  # kinds read "window+{g}x3"
               for kind, n in run.stats.step_kinds.items())
    assert run.stats.tokens_fed < flat


@pytest.mark.parametrize("W,N,G", [(0, 3, 1), (2, 1, 1), (2, 3, -1)])
def test_invalid_settings(W: int, N: int, G: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        Lookahead(window=W, ngram=N, guesses=G)


SETTINGS = [(1, 2, 0), (1, 2, 3), (3, 2, 2), (1, 4, 2), (4, 3, 4), (5, 4, 5), (2, 5, 1), (7, 5, 7), (4, 6, 0)]


def checked_runs(model, seed: int, strategies: list, trials: int = 3, max_new_tokens: int = 48) -> list:
    """(strategy, run) of every strategy on `trials` random prompts, each output asserted equal to autoregressive."""
    gen = torch.Generator().manual_seed(seed)
    runs = []
    for trial in range(trials):
        length = int(torch.randint(1, 24, (1,), generator=gen))
        prompt = torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
        expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=max_new_tokens)
        for strategy in strategies:
            got, run = run_tokens(model, prompt, strategy, max_new_tokens=max_new_tokens)
            assert got == expected, (prompt, strategy)
            runs.append((strategy, run))
    return runs


@pytest.mark.parametrize("model_seed", range(4))
def test_greedy_lookahead_equals_autoregressive(model_seed: int) -> None:
    """The central invariant, over random tiny models, prompts and (W, N, G)."""
    model = tiny_model(vocab=12 + 4 * model_seed, seed=model_seed)
    strategies = [Lookahead(W, N, G, pool_from_prompt=p) for W, N, G in SETTINGS for p in (True, False)]
    runs = checked_runs(model, 100 + model_seed, strategies)
    assert all(max(run.stats.tokens_per_step) <= s.ngram for s, run in runs)
    assert any(run.stats.forward_passes < run.stats.new_tokens for _, run in runs), \
        "lookahead never accepted a candidate: the test would prove nothing"


def test_stop_inside_an_accepted_block_cuts_where_autoregressive_stops() -> None:
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4]
    reference, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=60)
    strategy = Lookahead(5, 4, 5)
    _, run = run_tokens(model, prompt, strategy, max_new_tokens=60)
    assert max(run.stats.tokens_per_step) > 1
    for budget in range(1, 25):
        got, run = run_tokens(model, prompt, strategy, max_new_tokens=budget)
        assert got == reference[:budget] and run.finish_reason == "length" and run.stats.new_tokens == budget
    for eos in set(reference[1:30]):
        cut = reference.index(eos) + 1
        got, run = run_tokens(model, prompt, strategy, max_new_tokens=60, eos_ids=[eos])
        assert got == reference[:cut] and run.finish_reason == "eos"


def test_near_the_end_of_the_context_falls_back_to_single_steps() -> None:
    model = tiny_model(vocab=12, seed=2)
    limit = model.config.max_seq_len
    prompt = ([1, 2, 3] * 100)[:limit - 20]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=50)
    got, run = run_tokens(model, prompt, Lookahead(7, 5, 7), max_new_tokens=50)
    assert got == expected and len(got) == 20 and run.finish_reason == "context"


def test_step_counts_are_reproducible() -> None:
    model = tiny_model(vocab=16, seed=3)
    prompt = [3, 4, 5, 6, 7, 3, 4]
    runs = [run_tokens(model, prompt, Lookahead(4, 4, 4, seed=7))[1].stats for _ in range(2)]
    assert runs[0].steps == runs[1].steps and runs[0].tokens_per_step == runs[1].tokens_per_step


def test_float64_and_every_setting_combination_small() -> None:
    model = tiny_model(vocab=10, seed=5, dtype=torch.float64)
    prompt = [1, 2, 3, 1, 2]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=24)
    for W, N, G in itertools.product([1, 2, 3], [2, 3, 4], [0, 1, 3]):
        got, _ = run_tokens(model, prompt, Lookahead(W, N, G), max_new_tokens=24)
        assert got == expected, (W, N, G)


def test_without_the_bonus_token_a_step_emits_at_most_n_minus_1() -> None:
    """The published reference's cap, kept as an option for comparisons: same output, shorter steps."""
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4] * 6
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=40)
    with_bonus, run = run_tokens(model, prompt, Lookahead(4, 4, 4), max_new_tokens=40)
    without, capped = run_tokens(model, prompt, Lookahead(4, 4, 4, bonus_token=False), max_new_tokens=40)
    assert with_bonus == without == expected
    assert max(run.stats.tokens_per_step) == 4 and max(capped.stats.tokens_per_step) == 3


# ---- suffix drafts (ragged candidates of any length) -------------------------------------------------------------

SUFFIX_SETTINGS = [dict(window=1, ngram=2, guesses=0, suffix_draft=6),
                   dict(window=3, ngram=3, guesses=2, suffix_draft=9, suffix_branches=3),
                   dict(window=4, ngram=4, guesses=4, suffix_draft=1, suffix_branches=2)]


@pytest.mark.parametrize("model_seed", range(3))
def test_greedy_with_suffix_drafts_equals_autoregressive(model_seed: int) -> None:
    model = tiny_model(vocab=8 + 4 * model_seed, seed=model_seed)
    runs = checked_runs(model, 200 + model_seed, [Lookahead(**settings) for settings in SUFFIX_SETTINGS])
    assert all(max(run.stats.tokens_per_step) <= s.suffix_draft + s.ngram for s, run in runs)
    assert any(max(run.stats.tokens_per_step) > s.ngram for s, run in runs), \
        "no step emitted more than N tokens: suffix drafts were never accepted past N - 1"


def test_suffix_drafts_near_the_end_of_the_context_never_overrun_it() -> None:
    model = tiny_model(vocab=12, seed=2)
    limit = model.config.max_seq_len
    prompt = ([1, 2, 3] * 200)[:limit - 30]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=50)
    strategy = Lookahead(1, 2, 0, suffix_draft=64, suffix_branches=2)  # drafts far longer than the room left
    got, run = run_tokens(model, prompt, strategy, max_new_tokens=50)
    assert got == expected and len(got) == 30 and run.finish_reason == "context"
    assert run.stats.steps < 29  # drafts were accepted, cut to the room left


@pytest.mark.parametrize("field,value,message", [
    ("suffix_draft", -1, "suffix_draft .* must be a whole number >= 0"),
    ("suffix_draft", 2.5, "suffix_draft .* must be a whole number >= 0"),
    ("suffix_branches", 0, "suffix_branches .* must be a whole number >= 1"),
    ("suffix_branches", True, "suffix_branches .* must be a whole number >= 1"),
])
def test_invalid_suffix_settings(field: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Lookahead(**{field: value})


def test_suffix_drafts_are_off_by_default_and_budget_the_cache() -> None:
    assert Lookahead(7, 5, 7).max_step_tokens() == 56
    assert Lookahead(7, 5, 7, suffix_draft=16, suffix_branches=2).max_step_tokens() == 56 + 32


@pytest.mark.parametrize("model_seed", range(2))
def test_greedy_with_recycled_drafts_equals_autoregressive(model_seed: int) -> None:
    model = tiny_model(vocab=10 + 4 * model_seed, seed=model_seed)
    strategies = [Lookahead(1, 3, 0, recycle_topk=3), Lookahead(3, 4, 2, recycle_topk=2, suffix_draft=5)]
    runs = checked_runs(model, 300 + model_seed, strategies, max_new_tokens=40)
    assert any(run.stats.forward_passes < run.stats.new_tokens for _, run in runs)


def test_recycling_budgets_the_cache_and_validates_k() -> None:
    assert Lookahead(7, 5, 7, recycle_topk=3).max_step_tokens() == 56 + 3 * 4
    with pytest.raises(ValueError, match="recycle_topk .* must be a whole number >= 0"):
        Lookahead(recycle_topk=-1)


WINDOW_OPTIONS = [dict(window_chain=True), dict(reanchor=True), dict(seed_window=True), dict(fill_levels=True),
                  dict(window_chain=True, reanchor=True, seed_window=True, fill_levels=True, suffix_draft=4)]


@pytest.mark.parametrize("model_seed", range(3))
def test_greedy_with_the_window_options_equals_autoregressive(model_seed: int) -> None:
    model = tiny_model(vocab=8 + 4 * model_seed, seed=model_seed)
    strategies = [Lookahead(W, N, G, **options) for W, N, G in [(3, 4, 2), (1, 2, 1), (5, 3, 0)]
                  for options in WINDOW_OPTIONS]
    runs = checked_runs(model, 400 + model_seed, strategies)
    chained = [run for s, run in runs if s.window_chain and s.guesses == 0]
    assert any(run.stats.forward_passes < run.stats.new_tokens for run in chained), \
        "the window's chain was never accepted: the test would prove nothing"


def test_the_window_chain_is_the_freshest_guess_per_position() -> None:
    from minilade.decoding.base import DecodeContext
    from minilade.sampling import Sampler, SamplingParams

    model = tiny_model(vocab=50, seed=0)
    ctx = DecodeContext(model, model.new_cache(64), Sampler(SamplingParams(), model.device, [1], 50), [1, 2, 3], 64)
    decoder = Lookahead(3, 4, 0, window_chain=True).make_decoder(ctx)
    decoder.window = torch.tensor([[0, 1, 2], [10, 11, 12], [20, 21, 22]])  # slot (l, c) guesses x's + l + c
    assert decoder.window_chain() == ()  # the model has not written the levels yet
    decoder.model_levels = 2
    assert decoder.window_chain() == (10, 20, 21, 22)  # positions x's + 1, + 2, + 3, + 4
    assert Lookahead(3, 4, 0, window_chain=True).max_step_tokens() == 9 + 4


def test_reanchoring_moves_the_columns_by_the_extra_tokens() -> None:
    from minilade.decoding.base import DecodeContext
    from minilade.sampling import Sampler, SamplingParams

    model = tiny_model(vocab=50, seed=0)
    ctx = DecodeContext(model, model.new_cache(64), Sampler(SamplingParams(), model.device, [1], 50),
                        [40, 41, 42, 43], 64)  # no token recurs: no suffix draft fills the opened columns
    decoder = Lookahead(4, 3, 0, reanchor=True).make_decoder(ctx)
    decoder.window = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13]])
    decoder.moved(2)
    assert decoder.window.tolist() == [[2, 3, 2, 3], [12, 13, 12, 13]]
    ctx.tokens += [5, 6, 5]  # now "5" occurred before, followed by 6 5: the draft 6 5 6 5 ...
    decoder.moved(1)
    assert decoder.window.tolist() == [[3, 2, 3, 6], [13, 12, 13, 5]]  # slot (l, 3) takes guess l + 2
    off = Lookahead(4, 3, 0).make_decoder(ctx)
    before = off.window.clone()
    off.moved(2)
    assert torch.equal(off.window, before)


def test_filling_level_by_level_feeds_the_written_levels_only() -> None:
    model = tiny_model(vocab=12, seed=1)
    prompt = [1, 2, 3, 4, 5, 6]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=30)
    got, filled = run_tokens(model, prompt, Lookahead(3, 5, 0, fill_levels=True), max_new_tokens=30)
    _, full = run_tokens(model, prompt, Lookahead(3, 5, 0), max_new_tokens=30)
    assert got == expected
    # The first three steps feed 1, 2 and 3 levels of 3 rows instead of 4 levels (G = 0: no candidates).
    assert full.stats.tokens_fed - filled.stats.tokens_fed == (12 - 3) + (12 - 6) + (12 - 9)
