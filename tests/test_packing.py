"""Prepacked weights change how multi-token steps are computed, not what they compute."""

from __future__ import annotations

import copy

import pytest
import torch

from minilade.decoding import Autoregressive
from minilade.decoding.lookahead import Lookahead
from minilade.device import pack_linears, packing_available

from .helpers import run_tokens, tiny_model

pytestmark = pytest.mark.skipif(not packing_available(torch.float32, torch.device("cpu")),
                                reason="this torch build has no oneDNN prepacking")


def test_packed_model_computes_the_same_logits() -> None:
    model = tiny_model(vocab=50, std=0.1)
    packed = pack_linears(copy.deepcopy(model))
    assert packed.output.min_rows == 3 and packed.output.weight is packed.tok_embeddings.weight
    tokens = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for T in (1, 2, 5, 12):  # plain weights below 3 rows, prepacked ones from 3 on
            expected = model(tokens[:, :T], torch.arange(T), model.new_cache(16))
            got = packed(tokens[:, :T], torch.arange(T), packed.new_cache(16))
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packed_lookahead_equals_packed_autoregressive() -> None:
    model = pack_linears(tiny_model(vocab=12, seed=2))
    prompt = [1, 2, 3, 1, 2, 3, 4]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=40)
    for settings in [(4, 4, 4), (7, 5, 7), (1, 2, 3)]:
        got, run = run_tokens(model, prompt, Lookahead(*settings), max_new_tokens=40)
        assert got == expected and run.stats.compression > 1.0
