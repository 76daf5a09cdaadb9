"""Lookahead decoding: exact equality with autoregressive output, budgets, EOS, the context's end."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from minilade.config import ModelConfig
from minilade.decoding import Autoregressive, Lookahead
from minilade.decoding.base import DecodeContext, StepKind
from minilade.decoding.lookahead import JacobiWindow
from minilade.kv_cache import KVCache
from minilade.masks import LookaheadLayout
from minilade.sampling import Sampler, SamplingParams

from ..helpers import checked_runs, run_tokens, tiny_model


def test_shared_prefixes_feed_fewer_tokens_with_the_same_output() -> None:
    model = tiny_model(vocab=8, seed=3)  # a tiny vocabulary: many candidates share their first tokens
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=40)
    got, run = run_tokens(model, prompt, Lookahead(3, 4, 6), max_new_tokens=40)
    assert got == expected
    window_rows = LookaheadLayout(3, 4, 6).n_window_rows
    flat = sum(n * (window_rows + kind.paths * kind.depth) for kind, n in run.stats.step_kinds.items())
    assert run.stats.tokens_fed < flat


@pytest.mark.parametrize("W,N,G", [(0, 3, 1), (2, 1, 1), (2, 3, -1)])
def test_invalid_settings(W: int, N: int, G: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        Lookahead(window=W, ngram=N, guesses=G)


SETTINGS = [(1, 2, 0), (1, 2, 3), (3, 2, 2), (1, 4, 2), (4, 3, 4), (5, 4, 5), (2, 5, 1), (7, 5, 7), (4, 6, 0)]


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


# ---- the window and the pool, traced by hand -----------------------------------------------------------------------


class CountingModel(torch.nn.Module):
    """A stand-in for the model whose next token is always (position + 1) % vocab, whatever the text: the true
    continuation of any text is known, so every step's outcome can be traced by hand. It records each call's
    positions and the rows read."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.config = ModelConfig.preset("tiny-gqa").replace(vocab_size=vocab)
        self.device = torch.device("cpu")
        self.calls: list[tuple[list[int], list[int]]] = []

    def forward(self, tokens, input_pos, cache, mask=None, logits_rows=None, prefill=False):
        positions = input_pos.reshape(-1)
        rows = torch.arange(tokens.shape[1]) if logits_rows is None else logits_rows
        self.calls.append((positions.tolist(), rows.tolist()))
        return F.one_hot((positions[rows] + 1) % self.config.vocab_size, self.config.vocab_size).float()[None]


def test_the_window_pools_its_columns_and_a_later_step_accepts_one() -> None:
    """W = 2, N = 3, G = 2 over a model that counts: step 1 writes the first model level, step 2 pools the
    columns (4 5 6) and (5 6 7), step 3 verifies (6 7) after x = 5 and accepts it with its bonus token 8. Without
    the window's n-grams the pool would hold only (3 4) after 5, and step 3 would emit one token."""
    model = CountingModel(vocab=10)
    ctx = DecodeContext(model, KVCache(model.config, 32), Sampler(SamplingParams()), [5, 5, 5], limit=32)
    decoder = Lookahead(window=2, ngram=3, guesses=2).make_decoder(ctx)
    assert decoder.window.tokens.tolist() == [[5, 5], [5, 5]]  # drawn from the prompt
    assert decoder.prefill().tokens == [3]  # position 3

    first = decoder.step()  # x = 3 at position 3; the pool has nothing after 3
    # Rows: x, level 0 column 1, level 1 columns 0 and 1, at x's position + level + column; read: x, level 1.
    assert model.calls[-1] == ([3, 4, 4, 5], [0, 2, 3])
    assert first.tokens == [4] and first.kind == StepKind(window=True)
    assert decoder.window.tokens.tolist() == [[5, 5], [5, 6]]  # level 1 moved down, the new level (5, 6) on top
    assert decoder.pool.candidates(4, 2) == []  # the upper level was still the prompt's: nothing pooled

    second = decoder.step()  # x = 4; the window's levels are now the model's own
    assert second.tokens == [5] and decoder.window.tokens.tolist() == [[5, 6], [6, 7]]
    assert decoder.pool.candidates(4, 2) == [(5, 6)]  # column 0: 4 5 6
    assert decoder.pool.candidates(5, 2) == [(6, 7), (3, 4)]  # column 1: 5 6 7, beside the text's 5 3 4

    third = decoder.step()  # x = 5: (6 7) and (3 4) verified; the model's 6 7 accepts the first, 8 follows
    assert third.tokens == [6, 7, 8]
    assert (third.detail.winner, third.detail.n_accepted, third.detail.matches) == (0, 2, [2, 0])
    assert third.kind == StepKind(window=True, paths=2, depth=2) and ctx.cache.length == 8


def test_the_window_advance_equals_its_loop_form() -> None:
    """JacobiWindow.advance against the same update written as loops over levels and columns."""
    gen = torch.Generator().manual_seed(0)
    for levels, W in [(1, 3), (2, 2), (4, 5)]:
        window = JacobiWindow(LookaheadLayout(W, levels + 1, 0), list(range(20)), seed=levels)
        for step in range(levels + 2):
            before = window.tokens.tolist()
            new = torch.randint(20, (W,), generator=gen).tolist()
            ngrams = window.advance(new)
            expected = [tuple(before[level][c] for level in range(levels)) + (new[c],) for c in range(W)]
            assert ngrams == (expected if step >= levels - 1 else [])
            assert window.tokens.tolist() == before[1:] + [new]
