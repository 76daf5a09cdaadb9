"""Sampling: the warpers, the lossless verifier, and a statistical test that lookahead keeps the distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import minilade.decoding.lookahead
from minilade.decoding import Autoregressive
from minilade.decoding.lookahead import Lookahead
from minilade.sampling import Sampler, SamplingParams, warp
from minilade.verify import sample_verify

from .helpers import run_tokens, tiny_model

# ---- warping ------------------------------------------------------------------------------------------------

def test_warp_temperature_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    torch.testing.assert_close(warp(logits, SamplingParams(temperature=1.0)), logits.exp())
    hot = warp(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(hot, logits.exp().sqrt() / logits.exp().sqrt().sum())
    top2 = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too; 0.1 is not.
    top_p = warp(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(top_p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    only_best = warp(logits, SamplingParams(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(only_best, torch.tensor([1.0, 0, 0, 0, 0]))


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                                    dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_p=1.5)])
def test_invalid_sampling_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(top_k=5), dict(top_p=0.9)])
def test_top_k_and_top_p_without_a_temperature_are_an_error(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="apply only when sampling"):
        SamplingParams(**kwargs)


# ---- the verifier with stub distributions ----------------------------------------------------------------------

class ScriptedSampler(Sampler):
    """Plays back given uniforms and records the distribution of every draw (which returns its argmax)."""

    def __init__(self, uniforms: list[float]) -> None:
        super().__init__(SamplingParams(temperature=1.0, seed=0))
        self.uniforms = torch.tensor(uniforms)
        self.draws: list[torch.Tensor] = []

    def uniform(self, n: int, device) -> torch.Tensor:
        assert n == self.uniforms.numel()
        return self.uniforms.clone()

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        self.draws.append(probs.clone())
        return probs.argmax(-1)


V = 6
P0 = torch.tensor([0.05, 0.3, 0.35, 0.1, 0.15, 0.05])  # the model's distribution after x


def after(*probs: float) -> torch.Tensor:
    """Logits whose softmax is the given distribution (temperature 1 leaves it unchanged)."""
    return torch.log(torch.tensor(probs))


D1 = after(0.1, 0.1, 0.1, 0.4, 0.2, 0.1)  # after candidate token 1
D2 = after(0.3, 0.2, 0.1, 0.1, 0.2, 0.1)
D3 = after(0.2, 0.2, 0.2, 0.2, 0.1, 0.1)


def verify(candidates: list[list[int]], cand_logits: list[list[torch.Tensor]], uniforms: list[float]):
    sampler = ScriptedSampler(uniforms)  # uniforms are laid out (position, candidate)
    best, n, emitted = sample_verify(P0, torch.tensor(candidates), torch.stack([torch.stack(r) for r in cand_logits]),
                                     sampler)
    return int(best), int(n), emitted[:int(n) + 1].tolist(), sampler.draws


def test_one_candidate_accepted_with_probability_p() -> None:
    # p(1) = 0.3: u = 0.29 accepts token 1; the bonus token is drawn from the distribution after it.
    best, n, emitted, draws = verify([[1]], [[D1]], [0.29])
    assert (best, n) == (0, 1) and emitted == [1, 3]
    torch.testing.assert_close(draws[0], D1.softmax(-1))
    # u = 0.31 rejects it; the step emits a draw from p with token 1's mass removed.
    best, n, emitted, draws = verify([[1]], [[D1]], [0.31])
    assert n == 0 and emitted == [2]
    torch.testing.assert_close(draws[0], torch.tensor([0.05, 0, 0.35, 0.1, 0.15, 0.05]) / 0.7)


def test_second_candidate_tried_against_the_renormalised_residual() -> None:
    # Token 1 (p 0.3) rejected; token 2 is then accepted with probability 0.35 / 0.7 = 0.5.
    candidates, logits = [[1], [2]], [[D1], [D2]]
    assert verify(candidates, logits, [0.9, 0.49])[:3] == (1, 1, [2, 0])
    best, n, emitted, draws = verify(candidates, logits, [0.9, 0.51])
    assert n == 0
    torch.testing.assert_close(draws[0], torch.tensor([0.05, 0, 0, 0.1, 0.15, 0.05]) / 0.35)


def test_duplicate_tokens_are_tried_once() -> None:
    # Candidates 0 and 1 both start with token 1; a rejection of token 1 must not be retried by candidate 1,
    # whose uniform (0.0) would otherwise accept it.
    best, n, emitted, draws = verify([[1, 3], [1, 4], [2, 0]], [[D1, D3], [D1, D3], [D2, D3]],
                                     [0.9, 0.0, 0.9, 0.9, 0.9, 0.9])
    assert n == 0
    torch.testing.assert_close(draws[0], torch.tensor([0.05, 0, 0, 0.1, 0.15, 0.05]) / 0.35)


def test_shared_prefix_continues_with_the_accepted_branch() -> None:
    # Both candidates start with token 1 (accepted, u 0.1 < 0.3). Position 1 uses the distribution after
    # token 1: candidate 0's token 3 (p 0.4) is rejected (u 0.5), candidate 1's token 4 then has
    # probability 0.2 / 0.6: u 0.3 accepts it, and the bonus comes from candidate 1's last row.
    candidates, logits = [[1, 3], [1, 4]], [[D1, D2], [D1, D3]]
    best, n, emitted, draws = verify(candidates, logits, [0.1, 0.0, 0.5, 0.3])
    assert (best, n) == (1, 2) and emitted == [1, 4, 0]
    torch.testing.assert_close(draws[0], D3.softmax(-1))
    # With u 0.35 > 1/3 token 4 is rejected too: the residual after token 1 without 3 and 4.
    best, n, emitted, draws = verify(candidates, logits, [0.1, 0.0, 0.5, 0.35])
    assert n == 1 and emitted[0] == 1
    torch.testing.assert_close(draws[0], torch.tensor([0.1, 0.1, 0.1, 0, 0, 0.1]) / 0.4)


# ---- the distribution of whole continuations ------------------------------------------------------------------

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
LENGTH = 4


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Probability of every continuation of PROMPT under autoregressive sampling, by enumeration."""
    vocab = model.config.vocab_size
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(LENGTH):
            grown = {}
            for prefix, p in probs.items():
                tokens = torch.tensor([PROMPT + list(prefix)])
                logits = model(tokens, torch.arange(tokens.shape[1]), model.new_cache(32))[0, -1]
                nxt = warp(logits, params)
                grown.update({prefix + (t,): p * float(nxt[t]) for t in range(vocab) if nxt[t] > 0})
            probs = grown
    return probs


def chi_square_p_value(counts: Counter, expected: dict[tuple[int, ...], float], n: int) -> float:
    """Goodness of fit; outcomes expected fewer than 5 times are pooled into one bin."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for outcome, p in expected.items():
        e = n * p
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[outcome], pooled_exp + e
            continue
        stat += (counts[outcome] - e) ** 2 / e
        df += 1
    unexpected = sum(c for o, c in counts.items() if o not in expected)
    pooled_obs += unexpected
    pooled_exp = max(pooled_exp, 1e-9)
    stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
    df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_counts(model, strategy, params: SamplingParams, n: int) -> tuple[Counter, int]:
    counts, steps_with_acceptance = Counter(), 0
    for seed in range(n):
        tokens, run = run_tokens(model, PROMPT, strategy, max_new_tokens=LENGTH,
                                 sampling=SamplingParams(params.temperature, params.top_k, params.top_p, seed))
        counts[tuple(tokens)] += 1
        steps_with_acceptance += sum(c for k, c in run.stats.tokens_per_step.items() if k > 1)
    return counts, steps_with_acceptance


N_SAMPLES = 2500
SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
            SamplingParams(temperature=1.3, top_p=0.9)]
LOOKAHEAD = Lookahead(window=3, ngram=3, guesses=4)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=6, seed=11, std=0.35)


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_lookahead_sampling_matches_autoregressive_distribution(model, params: SamplingParams) -> None:
    exact = exact_distribution(model, params)
    counts, accepted_steps = sample_counts(model, LOOKAHEAD, params, N_SAMPLES)
    assert accepted_steps > N_SAMPLES // 4, "too few accepted candidates for the test to mean anything"
    assert chi_square_p_value(counts, exact, N_SAMPLES) > 1e-3


def test_autoregressive_sampling_matches_exact_distribution(model) -> None:
    params = SETTINGS[0]
    counts, _ = sample_counts(model, Autoregressive(), params, N_SAMPLES)
    assert chi_square_p_value(counts, exact_distribution(model, params), N_SAMPLES) > 1e-3


def accept_unconditionally(probs0, candidates, cand_logits, sampler):
    """Wrong on purpose: takes the first candidate whole, as if drafts were always right."""
    emitted = torch.cat([candidates[0], sampler.draw(sampler.probs(cand_logits[0, -1])).view(1)])
    return torch.tensor(0), torch.tensor(candidates.shape[1]), emitted


def without_renormalisation(probs0, candidates, cand_logits, sampler):
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


@pytest.mark.parametrize("wrong", [accept_unconditionally, without_renormalisation])
def test_the_statistical_test_rejects_a_wrong_verifier(model, monkeypatch, wrong) -> None:
    monkeypatch.setattr(minilade.decoding.lookahead, "sample_verify", wrong)
    params, n = SETTINGS[0], 600  # far fewer samples than the correct verifier is held to
    counts, _ = sample_counts(model, LOOKAHEAD, params, n)
    assert chi_square_p_value(counts, exact_distribution(model, params), n) < 1e-6


# ---- limits and reproducibility ------------------------------------------------------------------------------

def test_temperature_towards_zero_is_greedy_lookahead() -> None:
    model = tiny_model(vocab=16, seed=4)
    prompt = [2, 5, 7, 2, 5, 7, 2]
    greedy, greedy_run = run_tokens(model, prompt, Lookahead(4, 4, 4), max_new_tokens=40)
    cold, cold_run = run_tokens(model, prompt, Lookahead(4, 4, 4), max_new_tokens=40,
                                sampling=SamplingParams(temperature=1e-5, seed=3))
    assert cold == greedy
    assert cold_run.stats.tokens_per_step == greedy_run.stats.tokens_per_step


@pytest.mark.parametrize("strategy", [Autoregressive(), Lookahead(3, 3, 3)], ids=str)
def test_seeded_sampling_is_reproducible(strategy) -> None:
    model = tiny_model(vocab=16, seed=5, std=0.1)
    prompt = [1, 2, 3]
    outputs = [run_tokens(model, prompt, strategy, max_new_tokens=30,
                          sampling=SamplingParams(temperature=1.0, seed=s))[0] for s in (1, 1, 2)]
    assert outputs[0] == outputs[1] and outputs[0] != outputs[2]


def test_exact_distribution_sums_to_one(model) -> None:
    assert math.isclose(sum(exact_distribution(model, SETTINGS[1]).values()), 1.0, rel_tol=1e-5)


def test_sampling_touches_no_global_rng() -> None:
    model = tiny_model(vocab=16, seed=6)
    state = torch.get_rng_state()
    run_tokens(model, [1, 2, 3, 1, 2], Lookahead(3, 3, 3), sampling=SamplingParams(temperature=1.0, seed=0))
    assert torch.equal(state, torch.get_rng_state())
