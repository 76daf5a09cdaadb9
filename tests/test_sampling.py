"""Sampling: warping, top-p without a whole sort, drawing, settings, seeded reproducibility, and no global random
state."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from minilade.decoding import Autoregressive, GenerationSettings, GenerationStats, Lookahead, TokenRun, decode_tokens
from minilade.sampling import NUCLEUS_FIRST, Sampler, SamplingParams, largest, nucleus, seeded, warp

from .helpers import run_tokens, tiny_model


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


def sorted_outside_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's rule over a whole descending sort: a token is dropped where the mass before it reaches top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    dropped = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    return dropped.scatter(-1, order, dropped)


@pytest.mark.parametrize("vocabulary", [5, NUCLEUS_FIRST + 1, 3000, 49152])
def test_top_p_keeps_what_a_whole_sort_keeps(vocabulary: int) -> None:
    """nucleus looks among the most likely tokens first and further only where it must: the tokens it keeps are
    those a whole sort's rule keeps, bit for bit, for nuclei of one token to all of them (flat distributions, past
    every first look), in batches of rows whose nuclei differ, with ties across the cut; their probabilities
    renormalised."""
    generator = torch.Generator().manual_seed(vocabulary)
    for trial in range(24):
        spread = (0.05, 0.5, 2.0, 8.0)[trial % 4]
        logits = torch.randn(3, vocabulary, generator=generator) * spread
        if trial % 3 == 0:
            logits = torch.round(logits * 2) / 2  # many equal logits: equal probabilities
        probs = torch.softmax(logits, -1)
        for top_p in (1e-6, 0.3, 0.9, 0.999, 1 - 1e-7):
            got = nucleus(probs, top_p)
            dropped = sorted_outside_nucleus(probs, top_p)
            want = probs.masked_fill(dropped, 0) / probs.masked_fill(dropped, 0).sum(-1, keepdim=True)
            if trial % 3 == 0:  # ties: which of equal tokens a sort puts first is its own choice; the kept values
                assert torch.equal(probs.masked_fill(got == 0, 0).sort(-1).values,
                                   probs.masked_fill(dropped, 0).sort(-1).values), (trial, top_p)
            else:
                assert torch.equal(got == 0, dropped), (trial, top_p)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
            assert (probs.masked_fill(got == 0, 0).amax(-1) == probs.amax(-1)).all()  # a most likely token stays


def test_draws_follow_the_distribution_and_refuse_what_is_none() -> None:
    """Sampler.draw takes each token with its probability (rows need not sum to 1; a chi-square test over 60,000
    draws), never one of probability 0, is reproducible from its seed, and refuses a row that is no distribution."""
    probs = torch.tensor([[0.0, 0.5, 0.2, 0.0, 0.25, 0.05]] * 2) * torch.tensor([[1.0], [3.0]])
    draws = Sampler(SamplingParams(temperature=1.0, seed=3)).draw(probs.repeat(30000, 1)).view(-1)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[0] == counts[3] == 0
    expected = probs[0] / probs[0].sum() * draws.numel()
    kept = expected > 0
    chi_square = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi_square < 16.3  # 3 degrees of freedom: p = 0.001
    again = Sampler(SamplingParams(temperature=1.0, seed=3)).draw(probs.repeat(30000, 1)).view(-1)
    assert torch.equal(draws, again)
    assert int(Sampler(SamplingParams(temperature=1.0)).draw(torch.tensor([0.0, 0.0, 1e-30, 0.0]))) == 2
    for broken in (torch.zeros(4), torch.tensor([0.5, math.nan, 0.5]), torch.tensor([0.5, math.inf])):
        with pytest.raises(ValueError, match="cannot sample"):
            Sampler(SamplingParams(temperature=1.0)).draw(broken)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                                    dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_p=1.5)])
def test_invalid_sampling_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(top_k=5), dict(top_p=0.9)])
def test_top_k_and_top_p_without_a_temperature_are_an_error(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="apply only when sampling"):
        SamplingParams(**kwargs)


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


def test_an_unseeded_generation_samples_with_the_seed_agree_gives() -> None:
    """The seed a sharded model's ranks share (DecodeContext.agree gives rank 0's) replaces only the missing seed:
    every other setting, penalties included, stays the caller's."""
    model = tiny_model(vocab=16, seed=5, std=0.1)
    penalized = SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
    settings = GenerationSettings(Lookahead(3, 3, 3), penalized, max_new_tokens=30)
    agreed = list(decode_tokens(model, [1, 2, 3], TokenRun(GenerationStats()), settings, agree=lambda seed: 11))
    assert agreed == run_tokens(model, [1, 2, 3], Lookahead(3, 3, 3), max_new_tokens=30,
                                sampling=dataclasses.replace(penalized, seed=11))[0]
    assert agreed != run_tokens(model, [1, 2, 3], Lookahead(3, 3, 3), max_new_tokens=30,
                                sampling=SamplingParams(temperature=1.0, seed=11))[0]  # the penalties matter


def test_only_an_unseeded_sampling_generation_asks_for_a_seed() -> None:
    def refuse(value: int) -> int:
        raise AssertionError("asked for a seed")

    for params in (SamplingParams(), SamplingParams(repetition_penalty=2.0), SamplingParams(temperature=1.0, seed=3)):
        assert seeded(params, refuse) is params
    fresh = [seeded(SamplingParams(temperature=1.0, top_k=4), lambda seed: seed) for _ in range(2)]
    assert fresh[0].seed != fresh[1].seed and fresh[0].top_k == 4  # from the OS: a new one each time


def test_sampling_touches_no_global_rng() -> None:
    model = tiny_model(vocab=16, seed=6)
    state = torch.get_rng_state()
    run_tokens(model, [1, 2, 3, 1, 2], Lookahead(3, 3, 3), sampling=SamplingParams(temperature=1.0, seed=0))
    assert torch.equal(state, torch.get_rng_state())


def test_penalties_by_hand() -> None:
    """HF repetition penalty (divide a positive logit, multiply a negative one), then OpenAI frequency (per
    occurrence in the output) and presence (once) penalties."""
    from minilade.penalties import TokenHistory, penalize
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.tensor([2.0, -2.0, 1.0, 3.0])
    seen = torch.tensor([True, True, False, False])
    counts = torch.tensor([1.0, 0.0, 2.0, 0.0])
    assert penalize(logits, seen, counts, params).tolist() == [0.25, -4.0, -0.25, 3.0]
    history = TokenHistory(params, prompt=[1], vocab_size=4, device="cpu")
    history.add([0])
    rows = history.penalize(torch.tensor([[[2.0, -2.0, 1.0, 3.0]] * 2]), drafts=torch.tensor([[3, 3]]))
    # Row 0 follows the draft's first 3 (seen once), row 1 its second (seen twice): each with its own history.
    assert rows[0, 0].tolist() == [0.25, -4.0, 1.0, 1.5 - 0.5 - 0.25]
    assert rows[0, 1].tolist() == [0.25, -4.0, 1.0, 1.5 - 1.0 - 0.25]


@pytest.mark.parametrize("kwargs,fact", [
    (dict(temperature="0.5"), "temperature must be >= 0"), (dict(temperature=1.0, top_k=2.5), "top_k must be >= 0"),
    (dict(temperature=1.0, top_p=[]), r"top_p must be in \(0, 1\]"), (dict(seed=1.5), "seed must be in"),
    (dict(temperature=True), "temperature must be"),
])
def test_values_of_the_wrong_type_are_value_errors(kwargs: dict, fact: str) -> None:
    """Found by the fuzzer through generation_config.json (a TypeError from a comparison before)."""
    with pytest.raises(ValueError, match=fact):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("shape", [(49152,), (3, 1000), (2, 4, 257)])
def test_largest_is_torch_argmax_ties_nans_and_infinities_included(shape: tuple[int, ...]) -> None:
    """sampling.largest (numpy's argmax on CPU float32) picks torch.argmax's index in every row: the first of equal
    values, a NaN over everything, -inf rows, strided views; other dtypes go to torch.argmax itself."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, shape, generator=gen).float()  # few values: many ties
    x.view(-1, shape[-1])[0, 5] = float("nan")
    x.view(-1, shape[-1])[-1] = -torch.inf
    for logits in (x, x[..., ::2], x.transpose(0, -1) if x.dim() > 1 else x, x.double(), x.bfloat16()):
        got = largest(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
