"""Device and dtype policy: invariant row tilings change how steps are computed, not what; --dtype auto is measured."""

from __future__ import annotations

import copy

import pytest
import torch

import minilade.device as device
from minilade.config import ModelConfig
from minilade.decoding import Autoregressive
from minilade.decoding.lookahead import Lookahead
from minilade.device import Invariance, choose_dtype, make_exact, resolve_dtype
from minilade.invariance import (
    COL_TILE,
    GPU_TILE,
    ROW_TILE,
    ExactAttention,
    PaddedKVCache,
    RowTiledLinear,
    attention_tiles,
)
from minilade.kv_cache import KVCache
from minilade.model import SDPAttention, Transformer
from minilade.quant import quantize_linears

from .helpers import run_tokens, tiny_model


def test_tiled_model_computes_the_same_logits() -> None:
    model = tiny_model(vocab=50, std=0.1)
    tiled = copy.deepcopy(model)
    assert make_exact(tiled).exact
    assert isinstance(tiled.output, RowTiledLinear) and tiled.output.weight is tiled.tok_embeddings.weight
    tokens = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for T in (1, 2, 5, 12):
            expected = model(tokens[:, :T], torch.arange(T), model.new_cache(16))
            got = tiled(tokens[:, :T], torch.arange(T), tiled.new_cache(16))
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_make_exact_times_only_the_float_layers_of_a_quantized_model(monkeypatch) -> None:
    """A quantized output head has no float weight to time: choosing between tilings must skip it."""
    model = quantize_linears(tiny_model(vocab=64), "int8")
    model.layers[0].feed_forward.w_down = torch.nn.Linear(*reversed(model.layers[0].feed_forward.w_down.codes.shape))
    monkeypatch.setattr(device, "packing_available", lambda dtype, dev: True)  # two tilings to choose between
    assert make_exact(model).exact
    assert isinstance(model.layers[0].feed_forward.w_down, RowTiledLinear)


def test_invariant_lookahead_equals_autoregressive() -> None:
    model = tiny_model(vocab=12, seed=2)
    make_exact(model)
    assert isinstance(model.layers[0].feed_forward.w_down, RowTiledLinear)
    prompt = [1, 2, 3, 1, 2, 3, 4]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=40)
    for settings in [(4, 4, 4), (7, 5, 7), (1, 2, 3)]:
        got, run = run_tokens(model, prompt, Lookahead(*settings), max_new_tokens=40)
        assert got == expected and run.stats.compression > 1.0


def test_make_exact_installs_the_exact_kernel() -> None:
    """A bare model runs SDPA over a plain cache; make_exact swaps in the exact kernel and its padded cache."""
    model = Transformer(ModelConfig.preset("tiny-gqa").replace(vocab_size=50)).init_random().eval()
    assert type(model.attention_kernel) is SDPAttention and type(model.new_cache(8)) is KVCache
    assert make_exact(model).exact
    assert isinstance(model.attention_kernel, ExactAttention) and type(model.new_cache(8)) is PaddedKVCache


def test_attention_pads_to_larger_tiles_on_a_gpu() -> None:
    assert attention_tiles("cpu") == (ROW_TILE, COL_TILE)
    assert attention_tiles(torch.device("cuda", 1)) == attention_tiles("cuda") == (GPU_TILE, GPU_TILE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_on_cuda(dtype: torch.dtype) -> None:
    """On a GPU make_exact passes the whole-model check, and greedy lookahead is plain decoding token for token."""
    model = Transformer(ModelConfig.preset("tiny-gqa").replace(vocab_size=12)).init_random(seed=2, std=0.3)
    model = model.to("cuda", dtype).eval()
    model.setup_rope()
    assert make_exact(model).exact
    prompt = [1, 2, 3, 1, 2, 3, 4]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=40)
    got, run = run_tokens(model, prompt, Lookahead(7, 5, 7), max_new_tokens=40)
    assert got == expected and run.stats.compression > 1.0


def test_resolve_dtype() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == resolve_dtype(None, cpu) == torch.float32  # then choose_dtype measures
    assert resolve_dtype("bf16", cpu) == torch.bfloat16 and resolve_dtype(torch.float64, cpu) == torch.float64
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", cpu)


@pytest.mark.parametrize("faster", [torch.bfloat16, torch.float32], ids=str)
def test_choose_dtype_takes_the_faster_exact_dtype(faster: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(device, "_step_seconds", lambda model, path: 1.0 if model.dtype == faster else 2.0)
    model = tiny_model(vocab=50, std=0.1)
    chosen = choose_dtype(model)
    assert chosen.dtype == faster and (chosen is model) == (faster == torch.float32)
    tokens = torch.arange(10)[None]
    with torch.no_grad():
        got = chosen(tokens, torch.arange(10), chosen.new_cache(16)).float()
        expected = model(tokens, torch.arange(10), model.new_cache(16))
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)


def test_choose_dtype_skips_a_dtype_that_is_not_exact(monkeypatch) -> None:
    monkeypatch.setattr(device, "_step_seconds", lambda model, path: 1.0 if model.dtype == torch.bfloat16 else 2.0)
    real = device.make_exact
    monkeypatch.setattr(device, "make_exact", lambda model, path=None, warn=True: (
        Invariance(False, {}) if model.dtype == torch.bfloat16 else real(model, path, warn=warn)))
    model = tiny_model(vocab=50)
    assert choose_dtype(model) is model
