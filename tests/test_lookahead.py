"""Lookahead decoding: the layout, the pool, greedy verification, and exact equality with autoregressive output."""

from __future__ import annotations

import itertools

import pytest
import torch

from minilade.decoding import Autoregressive
from minilade.decoding.lookahead import Lookahead
from minilade.masks import CandidateTree, LookaheadLayout
from minilade.ngram_pool import NGramPool
from minilade.verify import greedy_verify

from .helpers import run_tokens, tiny_model


def render(mask: torch.Tensor) -> list[str]:
    return ["".join("o" if v else "." for v in row) for row in mask.tolist()]


def test_mask_and_positions_literal() -> None:
    layout = LookaheadLayout(window=3, ngram=3, guesses=2)
    # rows: x, l0c1, l0c2 | l1c0, l1c1, l1c2 | cand0 (2 tokens) | cand1 (2 tokens)
    assert render(layout.mask()) == [
        "o.........",
        "oo........",
        "ooo.......",
        "o..o......",
        "oo..o.....",
        "ooo..o....",
        "o.....o...",
        "o.....oo..",
        "o.......o.",
        "o.......oo",
    ]
    assert layout.offsets().tolist() == [0, 1, 2, 1, 2, 3, 1, 2, 1, 2]
    assert layout.last_level_rows().tolist() == [3, 4, 5]
    assert layout.candidate_rows(2).tolist() == [[6, 7], [8, 9]]
    assert layout.max_rows == (3 + 2) * (3 - 1)


def test_mask_n2_is_jacobi_window_plus_single_token_candidates() -> None:
    layout = LookaheadLayout(window=3, ngram=2, guesses=2)
    assert render(layout.mask()) == ["o....", "oo...", "ooo..", "o..o.", "o...o"]
    assert layout.offsets().tolist() == [0, 1, 2, 1, 1]
    assert layout.last_level_rows().tolist() == [0, 1, 2]


def test_window_rows_see_a_chain_of_consecutive_positions() -> None:
    """Every row sees exactly one row per position from x up to its own position: a well-formed sequence."""
    for W, N, G in [(1, 2, 0), (4, 5, 3), (7, 5, 7), (2, 3, 1)]:
        layout = LookaheadLayout(W, N, G)
        mask, pos = layout.mask(), layout.offsets()
        for row in range(layout.max_rows):
            seen = sorted(pos[mask[row]].tolist())
            assert seen == list(range(int(pos[row]) + 1)), (W, N, G, row)


def test_candidates_sharing_a_prefix_share_rows() -> None:
    tree = CandidateTree.build(torch.tensor([[5, 6, 7], [5, 6, 8], [5, 9, 1], [2, 3, 4]]))
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4]  # 9 rows instead of 12
    assert tree.depth.tolist() == [0, 1, 2, 2, 1, 2, 0, 1, 2]
    assert tree.node_of.tolist() == [[0, 1, 2], [0, 1, 3], [0, 4, 5], [6, 7, 8]]
    assert render(tree.mask) == [
        "o........",
        "oo.......",
        "ooo......",
        "oo.o.....",  # 8 sees 5, 6 and itself, not its sibling 7
        "o...o....",
        "o...oo...",
        "......o..",
        "......oo.",
        "......ooo",
    ]


def test_a_trie_without_shared_prefixes_is_the_flat_candidate_block() -> None:
    layout = LookaheadLayout(window=3, ngram=4, guesses=3)
    tree = CandidateTree.build(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
    n = layout.n_window_rows
    assert torch.equal(tree.mask, layout.mask()[n:, n:])
    assert torch.equal(tree.depth + 1, layout.offsets()[n:])


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


def test_pool_keeps_most_recent_distinct_continuations() -> None:
    pool = NGramPool(ngram=3, capacity=2)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (2, 3))  # seen again: now the most recent, not a duplicate
    assert pool.candidates(1, 5) == [(2, 3), (4, 5)]
    pool.add(1, (6, 7))  # evicts the least recently seen, (4, 5)
    assert pool.candidates(1, 5) == [(6, 7), (2, 3)]
    assert pool.candidates(1, 1) == [(6, 7)]
    assert pool.candidates(9, 5) == []
    assert len(pool) == 2


def test_pool_add_ngrams_from_a_start_index() -> None:
    pool = NGramPool(ngram=3, capacity=4)
    pool.add_ngrams([1, 2, 3, 1, 2, 4])
    assert pool.candidates(1, 4) == [(2, 4), (2, 3)]
    assert pool.candidates(2, 4) == [(3, 1)]
    assert pool.candidates(3, 4) == [(1, 2)]
    pool = NGramPool(ngram=3, capacity=4)
    pool.add_ngrams([1, 2, 3, 1, 2, 4], start=2)
    assert pool.candidates(1, 4) == [(2, 4)] and pool.candidates(2, 4) == []


def greedy(first: int, candidates: list[list[int]], choices: list[list[int]]) -> tuple[int, int, list[int]]:
    best, n, chain, _ = greedy_verify(torch.tensor(first), torch.tensor(candidates), torch.tensor(choices))
    return int(best), int(n), chain[:int(n) + 1].tolist()


def test_greedy_verify_full_match_keeps_bonus_token() -> None:
    # The model says 5 after x, 6 after 5, 7 after 6: candidate [5, 6] fully matches, 7 is the bonus token.
    assert greedy(5, [[5, 6]], [[6, 7]]) == (0, 2, [5, 6, 7])


def test_greedy_verify_partial_and_longest_match() -> None:
    candidates = [[5, 9, 9], [5, 6, 9], [4, 6, 7]]
    choices = [[6, 1, 1], [6, 7, 8], [6, 7, 8]]
    assert greedy(5, candidates, choices) == (1, 2, [5, 6, 7])


def test_greedy_verify_no_match_emits_models_token() -> None:
    assert greedy(3, [[5, 6], [4, 4]], [[6, 7], [4, 4]]) == (0, 0, [3])


def test_greedy_verify_tie_goes_to_earlier_candidate() -> None:
    assert greedy(5, [[5, 1], [5, 2]], [[3, 3], [3, 3]])[:2] == (0, 1)


SETTINGS = [(1, 2, 0), (1, 2, 3), (3, 2, 2), (1, 4, 2), (4, 3, 4), (5, 4, 5), (2, 5, 1), (7, 5, 7), (4, 6, 0)]


@pytest.mark.parametrize("model_seed", range(4))
def test_greedy_lookahead_equals_autoregressive(model_seed: int) -> None:
    """The central invariant, over random tiny models, prompts and (W, N, G)."""
    model = tiny_model(vocab=12 + 4 * model_seed, seed=model_seed)
    gen = torch.Generator().manual_seed(100 + model_seed)
    accepted_more_than_one = 0
    for trial in range(3):
        length = int(torch.randint(1, 24, (1,), generator=gen))
        prompt = torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
        expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=48)
        for W, N, G in SETTINGS:
            for from_prompt in (True, False):
                got, run = run_tokens(model, prompt, Lookahead(W, N, G, pool_from_prompt=from_prompt),
                                      max_new_tokens=48)
                assert got == expected, (prompt, W, N, G, from_prompt)
                assert max(run.stats.tokens_per_step) <= N
                accepted_more_than_one += run.stats.forward_passes < run.stats.new_tokens
    assert accepted_more_than_one > 0, "lookahead never accepted a candidate: the test would prove nothing"


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
