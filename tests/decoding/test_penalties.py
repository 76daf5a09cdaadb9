"""Repetition, presence and frequency penalties with every strategy: each verified row is penalized with its own
history (the committed text and its draft up to that row), so greedy lookahead and auto equal plain decoding
token for token and lookahead sampling keeps the autoregressive distribution; penalizing drafts with the
committed history only is caught."""

from __future__ import annotations

import pytest
import torch

from minilade.decoding import Auto, Autoregressive, Lookahead
from minilade.penalties import TokenHistory
from minilade.sampling import SamplingParams

from ..helpers import FLAT_COSTS, chi_square_p_value, exact_distribution, run_tokens, sample_counts, tiny_model

PENALTIES = [dict(repetition_penalty=1.3), dict(repetition_penalty=0.7), dict(presence_penalty=0.6),
             dict(frequency_penalty=0.8), dict(frequency_penalty=-1.0),
             dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.4)]
STRATEGIES = {"lookahead": Lookahead(3, 4, 3),
              "ragged": Auto(2, 3, 3, suffix_draft=6, suffix_branches=2, draft_budget=24, costs=FLAT_COSTS),
              "recycled": Auto(1, 4, 2, suffix_draft=0, recycle_topk=3, draft_budget=24, costs=FLAT_COSTS),
              "auto": Auto(3, 4, 3, recycle_topk=2, costs=FLAT_COSTS)}
PROMPT = [1, 2, 3, 4, 5] * 3
RIGHT_PENALIZE = TokenHistory.penalize


def committed_history_only(self, logits, drafts=None):
    """Wrong on purpose: every draft row penalized as if it followed the committed text directly."""
    flat = RIGHT_PENALIZE(self, logits.reshape(-1, logits.shape[-1]))
    return flat.view(logits.shape)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=12, seed=0, std=0.2)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_greedy_with_penalties_equals_plain_decoding(model, name: str, penalty: dict) -> None:
    params = SamplingParams(**penalty)
    expected, _ = run_tokens(model, PROMPT, Autoregressive(), max_new_tokens=40, sampling=params)
    unpenalized, _ = run_tokens(model, PROMPT, Autoregressive(), max_new_tokens=40)
    got, run = run_tokens(model, PROMPT, STRATEGIES[name], max_new_tokens=40, sampling=params)
    assert expected != unpenalized  # the penalty changes the text, so the comparison means something
    assert got == expected
    assert max(run.stats.tokens_per_step) > 1  # drafts were accepted under the penalty


def test_drafts_penalized_with_the_committed_history_only_are_caught(model, monkeypatch) -> None:
    """The test above fails for a verifier that ignores the draft's own tokens in a row's history: some draft
    that repeats a token is then accepted where plain decoding, penalizing the repeat, chose otherwise."""
    monkeypatch.setattr(TokenHistory, "penalize", committed_history_only)
    wrong = []
    for penalty in PENALTIES:
        params = SamplingParams(**penalty)
        expected, _ = run_tokens(model, PROMPT, Autoregressive(), max_new_tokens=40, sampling=params)
        got, _ = run_tokens(model, PROMPT, STRATEGIES["lookahead"], max_new_tokens=40, sampling=params)
        wrong.append(got != expected)
    assert sum(wrong) >= 2, wrong  # deterministic: frequency 0.8 and the combined setting here


N_SAMPLES = 2500
# Strong output penalties: the prompt holds most of the 6 tokens, so the repetition penalty would tell rows apart
# less than presence and frequency do.
SAMPLED = SamplingParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0)


@pytest.fixture(scope="module")
def small_model():
    return tiny_model(vocab=6, seed=11, std=0.35)


def test_lookahead_sampling_with_penalties_keeps_the_distribution(small_model) -> None:
    exact = exact_distribution(small_model, SAMPLED)
    counts, accepted_steps = sample_counts(small_model, Lookahead(window=3, ngram=3, guesses=4), SAMPLED, N_SAMPLES)
    assert accepted_steps > N_SAMPLES // 5, "too few accepted candidates for the test to mean anything"
    assert chi_square_p_value(counts, exact, N_SAMPLES) > 1e-3


def test_the_chi_square_test_catches_drafts_penalized_with_the_committed_history_only(small_model,
                                                                                    monkeypatch) -> None:
    exact = exact_distribution(small_model, SAMPLED)
    monkeypatch.setattr(TokenHistory, "penalize", committed_history_only)
    n = 2 * N_SAMPLES  # the error shows only in steps that accept a draft; seeded, so the p-value is fixed
    counts, _ = sample_counts(small_model, Lookahead(window=3, ngram=3, guesses=4), SAMPLED, n)
    assert chi_square_p_value(counts, exact, n) < 1e-3  # 1.6e-5 when written


@pytest.mark.parametrize("penalty,fact", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 and finite"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be > 0 and finite"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be > 0 and finite"),
    (dict(repetition_penalty="1.2"), "repetition_penalty must be > 0 and finite"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2, 2\]"),
])
def test_bad_penalties_are_one_line_errors(penalty: dict, fact: str) -> None:
    with pytest.raises(ValueError, match=fact):
        SamplingParams(**penalty)


def test_no_penalty_leaves_the_logits_untouched(model) -> None:
    """The plain path does no extra work: penalize hands back the very same tensor."""
    from minilade.sampling import Sampler
    logits = torch.randn(12)
    assert Sampler(SamplingParams(), prompt=[1, 2], vocab_size=12).penalize(logits) is logits
