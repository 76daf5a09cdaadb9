"""Drafts across requests: earlier answers draft for a new text; never across two answers; bounded; frozen."""

from __future__ import annotations

import pytest

from minilade.decoding import Autoregressive
from minilade.decoding.auto import Auto
from minilade.decoding.step_costs import StepCosts
from minilade.drafts.history import DraftHistory
from minilade.drafts.suffix import SuffixDraft, SuffixIndex

from ..helpers import run_tokens, tiny_model


def test_an_earlier_answer_drafts_what_followed_the_texts_longest_ending() -> None:
    history = DraftHistory(max_key=4)
    history.add([1, 2, 3, 4, 5])
    history.add([7, 2, 3, 9])
    # [2 3] occurred in both answers (latest first); [8 2 3] in neither; each draft stops at its answer's end
    assert history.drafts([8, 2, 3], 5, branches=3) == [SuffixDraft((9,), 2, 0), SuffixDraft((4, 5), 2, 1)]
    assert history.drafts([0, 1, 2], 2) == [SuffixDraft((3, 4), 2, 0)]
    assert history.drafts([6], 3) == [] and history.drafts([1, 2], 0) == []
    assert len(history) == 9


def test_no_key_spans_two_answers() -> None:
    history = DraftHistory(max_key=4)
    history.add([1, 2])
    history.add([3, 4])
    assert history.drafts([1, 2, 3], 2) == [SuffixDraft((4,), 1, 0)]  # only [3] matches: [2 3] never occurred
    index = SuffixIndex(max_key=3)
    index.update([1, 2, -1, 3])
    assert index.match([2, -1, 3, 5, 2, -1, 3]) == (1, [3])  # keys of the separated list hold no separator


def test_the_oldest_answers_go_first_and_frozen_keeps_it_as_it_is() -> None:
    history = DraftHistory(capacity=8, max_key=2)
    history.add([1, 2, 3])
    history.add([4, 5, 6])
    history.add([7, 8, 9])  # 9 tokens > 8: the oldest answers go, down to 3/4 of the capacity
    assert len(history) == 6 and history.drafts([0, 1], 3) == [] and history.drafts([4], 3) == [
        SuffixDraft((5, 6), 1, 0)]
    history.frozen = True
    history.add([1, 2, 3])
    assert len(history) == 6
    with pytest.raises(ValueError, match="history capacity must be a whole number of tokens >= 1"):
        DraftHistory(capacity=0)
    with pytest.raises(ValueError, match="history must be a DraftHistory"):
        Auto(history=[1, 2, 3])


def test_auto_with_a_history_stays_exact_and_drafts_a_repeated_answer() -> None:
    model = tiny_model(vocab=12, seed=1)
    costs = StepCosts({T: 1.0 + 0.01 * T for T in range(1, 128)})
    prompt_a, prompt_b = [1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]
    history = DraftHistory()
    expected_a, _ = run_tokens(model, prompt_a, Autoregressive())
    got, first = run_tokens(model, prompt_a, Auto(3, 3, 3, costs=costs, history=history))
    assert got == expected_a and len(history) == len(expected_a)  # the generation added its answer at its end
    got, again = run_tokens(model, prompt_a, Auto(3, 3, 3, costs=costs, history=history))
    assert got == expected_a and again.stats.forward_passes < first.stats.forward_passes
    expected_b, _ = run_tokens(model, prompt_b, Autoregressive())
    got, _ = run_tokens(model, prompt_b, Auto(3, 3, 3, costs=costs, history=history))
    assert got == expected_b  # drafts from an unrelated answer: still plain decoding's output


def test_a_generation_stopped_early_still_adds_what_it_emitted() -> None:
    from minilade.decoding.loop import GenerationSettings, GenerationStats, TokenRun, decode_tokens

    model = tiny_model(vocab=12, seed=1)
    history = DraftHistory()
    settings = GenerationSettings(Auto(3, 3, 3, costs=StepCosts({1: 1.0, 64: 2.0}), history=history),
                                  max_new_tokens=30)
    tokens = decode_tokens(model, [1, 2, 3], TokenRun(GenerationStats()), settings)
    first = [next(tokens) for _ in range(5)]
    tokens.close()  # the consumer stops (a stop string): the history gets the tokens it was handed
    assert len(history) == 5 and history.drafts(first[:1], 8) == [SuffixDraft(tuple(first[1:]), 1, 0)]
