"""Lookahead sampling is lossless: whole continuations come out with exactly the autoregressive distribution.

A chi-square test against the exact distribution (by enumeration on a tiny model), and the same test catching
deliberately wrong verifiers, so it is known to be able to fail.
"""

from __future__ import annotations

import math

import pytest
import torch

import minilade.verify
from minilade.decoding import Auto, Autoregressive, Lookahead
from minilade.sampling import SamplingParams

from ..helpers import FLAT_COSTS, chi_square_p_value, exact_distribution, sample_counts, tiny_model

N_SAMPLES = 2500
SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
            SamplingParams(temperature=1.3, top_p=0.9)]
LOOKAHEAD = Lookahead(window=3, ngram=3, guesses=4)
# auto feeding its whole budget: suffix drafts, paths of 1..4 tokens (a ragged trie), with the pool's candidates
RAGGED = Auto(window=2, ngram=3, guesses=3, suffix_draft=4, suffix_branches=2, costs=FLAT_COSTS)
# a tree from the model's own top-3 next tokens, with the pool's candidates
RECYCLED = Auto(window=1, ngram=3, guesses=2, suffix_draft=0, recycle_topk=3, costs=FLAT_COSTS)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=6, seed=11, std=0.35)


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_lookahead_sampling_matches_autoregressive_distribution(model, params: SamplingParams) -> None:
    exact = exact_distribution(model, params)
    counts, accepted_steps = sample_counts(model, LOOKAHEAD, params, N_SAMPLES)
    assert accepted_steps > N_SAMPLES // 4, "too few accepted candidates for the test to mean anything"
    assert chi_square_p_value(counts, exact, N_SAMPLES) > 1e-3


@pytest.mark.parametrize("strategy,params", [(RAGGED, SETTINGS[0]), (RAGGED, SETTINGS[1]), (RECYCLED, SETTINGS[0])],
                         ids=["ragged-" + str(SETTINGS[0]), "ragged-" + str(SETTINGS[1]), "recycled"])
def test_ragged_and_recycled_drafts_keep_the_autoregressive_distribution(model, strategy, params) -> None:
    exact = exact_distribution(model, params)
    counts, accepted_steps = sample_counts(model, strategy, params, N_SAMPLES)
    assert accepted_steps > N_SAMPLES // 4, "too few accepted candidates for the test to mean anything"
    assert chi_square_p_value(counts, exact, N_SAMPLES) > 1e-3


def test_autoregressive_sampling_matches_exact_distribution(model) -> None:
    params = SETTINGS[0]
    counts, _ = sample_counts(model, Autoregressive(), params, N_SAMPLES)
    assert chi_square_p_value(counts, exact_distribution(model, params), N_SAMPLES) > 1e-3


def accept_unconditionally(probs0, candidates, cand_logits, sampler, lengths=None):
    """Wrong on purpose: takes the first candidate whole, as if drafts were always right."""
    emitted = torch.cat([candidates[0], sampler.draw(sampler.probs(cand_logits[0, -1])).view(1)])
    return torch.tensor(0), torch.tensor(candidates.shape[1]), emitted


def without_renormalisation(probs0, candidates, cand_logits, sampler, lengths=None):
    """Wrong on purpose: tries each candidate token against the unrenormalised p and draws the final token
    from p itself instead of from the residual."""
    p, alive, best = probs0, torch.ones(candidates.shape[0], dtype=torch.bool), 0
    for i in range(candidates.shape[1]):
        winner = next((g for g in range(candidates.shape[0])
                       if alive[g] and float(sampler.uniform(1, "cpu")) < p[candidates[g, i]]), None)
        if winner is None:
            token = sampler.draw(p)
            return torch.tensor(best), torch.tensor(i), torch.cat([candidates[best, :i], token.view(1)])
        best = winner
        alive &= candidates[:, i] == candidates[winner, i]
        p = sampler.probs(cand_logits[winner, i])
    return torch.tensor(best), torch.tensor(candidates.shape[1]), torch.cat([candidates[best], sampler.draw(p).view(1)])


@pytest.mark.parametrize("strategy", [LOOKAHEAD, RAGGED, RECYCLED], ids=["n-1 candidates", "ragged", "recycled"])
@pytest.mark.parametrize("wrong", [accept_unconditionally, without_renormalisation])
def test_the_statistical_test_rejects_a_wrong_verifier(model, monkeypatch, wrong, strategy) -> None:
    monkeypatch.setattr(minilade.verify, "sample_verify", wrong)
    params, n = SETTINGS[0], 600  # far fewer samples than the correct verifier is held to
    counts, _ = sample_counts(model, strategy, params, n)
    assert chi_square_p_value(counts, exact_distribution(model, params), n) < 1e-6


def test_exact_distribution_sums_to_one(model) -> None:
    assert math.isclose(sum(exact_distribution(model, SETTINGS[1]).values()), 1.0, rel_tol=1e-5)
