"""A model split over 2 and 3 gloo ranks computes what the whole model computes, and decodes the same tokens.

Each test starts its ranks as processes (ranks.py); they write their results, compared here with the
single-process model loaded from the same checkpoint."""

from __future__ import annotations

import pytest
import torch

import minilade.decoding.step_costs as step_costs
from minilade import LLM
from minilade.checkpoints import open_checkpoint
from minilade.decoding import Autoregressive, Lookahead
from minilade.sampling import SamplingParams
from tests.helpers import run_tokens, tiny_model, write_tiny_checkpoint
from tests.parallel.ranks import check_ok, results, run_ranks
from tests.parallel.reference import GEN_PROMPT, PENALIZED, TEXT_PROMPT, WORDS, lookahead_step, prefill_and_step


def whole_model(folder, dtype=torch.float64):
    return open_checkpoint(folder).load_model(dtype=dtype, device="cpu")


@pytest.mark.parametrize("world", [2, 3])
def test_split_logits_equal_whole_model(world, even_checkpoint, one_kv_checkpoint, tmp_path):
    checkpoints = [str(even_checkpoint), str(one_kv_checkpoint)]  # heads split; one key/value head replicated
    check_ok(run_ranks(world, "logits", tmp_path, *checkpoints))
    ranks = results(tmp_path, world)
    for ckpt in checkpoints:
        want_prefill, want_step = prefill_and_step(whole_model(ckpt), lookahead_step())
        for got in ranks:
            torch.testing.assert_close(got[ckpt]["prefill"], want_prefill, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got[ckpt]["step"], want_step, rtol=1e-12, atol=1e-12)
            assert torch.equal(got[ckpt]["step"], ranks[0][ckpt]["step"])  # the same bits on every rank


def test_generation_on_two_ranks_equals_one_process(even_checkpoint, tmp_path):
    check_ok(run_ranks(2, "generate", tmp_path, str(even_checkpoint)))
    model = whole_model(even_checkpoint)
    greedy = run_tokens(model, GEN_PROMPT, Autoregressive(), max_new_tokens=30)[0]
    sampled = run_tokens(model, GEN_PROMPT, Lookahead(window=4, ngram=3, guesses=3), max_new_tokens=20,
                         sampling=SamplingParams(temperature=1.0, seed=7))[0]
    ranks = results(tmp_path, 2)
    for got in ranks:
        for name in ("autoregressive", "lookahead", "auto", "auto-drafting"):
            assert got[name] == greedy, name
        assert got["sampled-7"] == sampled
    assert ranks[0]["sampled-None"] == ranks[1]["sampled-None"]  # rank 0's seed, on both
    assert len(set(greedy)) > 3  # not a degenerate repetition


def test_unseeded_sampling_on_two_ranks_keeps_the_penalties(tmp_path):
    """Without a seed the ranks sample with rank 0's, and with every other setting the caller gave: at a temperature
    that draws the argmax, the tokens are penalized greedy decoding's on every rank."""
    ckpt = write_tiny_checkpoint(tmp_path, WORDS, max_positions=64)
    check_ok(run_ranks(2, "llm_penalized", tmp_path, str(ckpt), TEXT_PROMPT))
    one = LLM.load(ckpt, dtype="float32", device="cpu", progress=False, compile=False)
    penalties = {name: value for name, value in PENALIZED.items() if name != "temperature"}
    want = one.generate(TEXT_PROMPT, max_new_tokens=12, strategy=Autoregressive(), **penalties).token_ids
    assert want != one.generate(TEXT_PROMPT, max_new_tokens=12, strategy=Autoregressive()).token_ids  # they matter
    for got in results(tmp_path, 2):
        assert got == {"autoregressive": want, "lookahead": want}


def test_a_rank_other_than_0_steps_by_rank_0s_costs_and_keeps_none(monkeypatch, tmp_path):
    """step_costs_for as a rank other than 0 sees it: its agree hands back rank 0's missing sizes, ticket and
    figures. It measures with the others (every rank runs each step) but steps by rank 0's figures, and only
    rank 0 writes the cost file."""
    measured = []
    monkeypatch.setattr(step_costs, "measure_step_costs",
                        lambda model, sizes, **kw: measured.extend(sizes) or {T: 9.0 for T in sizes})
    # rank 0's missing sizes and ticket (no other rank's), its verdict that its table is plausible, its figures
    rank0 = {tuple: ([1, 4], -1), bool: True, dict: {1: 0.5, 4: 0.75}}

    def as_rank1(value):
        return rank0[type(value)]

    cost_file = tmp_path / "costs.json"
    costs = step_costs.step_costs_for(tiny_model(vocab=12, seed=1), [4], cost_file, agree=as_rank1)
    assert sorted(measured) == [1, 4] and costs(4) == 0.75 and not cost_file.exists()
