"""A token's logits must not depend on the shape of the step that computed them: bitwise, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

import minilade.invariance as invariance
from minilade.config import ModelConfig
from minilade.decoding import Autoregressive
from minilade.decoding.lookahead import Lookahead
from minilade.device import Invariance, check_invariance, make_exact
from minilade.invariance import (
    RowTiledLinear,
    RowTiling,
    find_tiling,
    invariant_attention,
    key_layout,
    pad_keys_values,
    tiled_matmul,
)
from minilade.masks import interleaved_step
from minilade.model import Transformer, step_visibility

from .helpers import run_tokens, tiny_model

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-mha"])
def test_one_row_step_equals_its_row_in_wide_steps(dtype: torch.dtype, preset: str) -> None:
    model = tiny_model(vocab=50, preset=preset, dtype=dtype)
    assert make_exact(model).exact
    # contexts on both sides of a key-chunk boundary (64) and past several; steps up to 64 rows, 2 to 8 lanes
    for contexts, width, lanes in [((1, 63, 64), 8, 2), ((5, 130), 40, 8), ((70,), 64, 3)]:
        assert check_invariance(model, contexts, width, lanes), (contexts, width, lanes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_wide_heads_keep_a_rows_bits_at_every_row_count(dtype: torch.dtype, head_dim: int) -> None:
    """Heads of 128 and 256 columns (LLaMA-7B's are 128): attention's scores summed in pieces of SCORE_COLUMNS
    (key_scores), since one float32 matmul over them rounds a call of 4 rows unlike a wider one on an AVX-512 Xeon."""
    config = ModelConfig.preset("tiny-gqa").replace(vocab_size=50, head_dim=head_dim)
    model = invariance.apply_exact_attention(Transformer(config).init_random(seed=0, std=0.3).to(dtype).eval())
    assert make_exact(model).exact
    assert check_invariance(model, (5, 70), 8, 2)


def test_key_scores_are_the_matmul_over_the_head_width() -> None:
    """key_scores sums the pieces' matmuls: the scores of one matmul, up to rounding (and its bits where the head
    width is one piece)."""
    generator = torch.Generator().manual_seed(0)
    qs, k = torch.randn(2, 3, 12, 200, generator=generator), torch.randn(2, 3, 40, 200, generator=generator)
    assert torch.allclose(invariance.key_scores(qs, k), qs @ k.transpose(-1, -2), atol=1e-4)
    assert torch.equal(invariance.key_scores(qs[..., :64], k[..., :64]), qs[..., :64] @ k[..., :64].transpose(-1, -2))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout) -> torch.Tensor:
    return invariant_attention(q, *pad_keys_values(keys, values, layout.keys), layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_row_ignores_other_rows_and_hidden_keys(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    past, T, H, Hkv, D = 100, 24, 6, 2, 16
    q = torch.randn(1, H, T, D, generator=gen).to(dtype)
    keys, values = (torch.randn(1, Hkv, past + T, D, generator=gen).to(dtype) for _ in range(2))
    positions, mask = interleaved_step(past, T, lanes=4)
    wide = attend(q, keys, values, key_layout(step_visibility(mask, past, T, "cpu"), past, 3, dtype))
    for r in (0, 5, 13, 23):
        seen = mask[r].nonzero().squeeze(1) + past  # the row's visible step rows, in position order
        k, v = (torch.cat([t[:, :, :past], t[:, :, seen]], dim=2) for t in (keys, values))
        n = seen.numel()
        one_row = key_layout(step_visibility(None, past + n - 1, 1, "cpu"), past + n - 1, 3, dtype)
        alone = attend(q[:, :, r:r + 1], k, v, one_row)
        assert torch.equal(alone[:, :, 0], wide[:, :, r]), r
        assert int(positions[r]) == past + n - 1  # the row's keys are a chain of consecutive positions


def test_attention_matches_softmax_attention() -> None:
    gen = torch.Generator().manual_seed(1)
    past, T = 150, 10
    q = torch.randn(1, 4, T, 8, generator=gen, dtype=torch.float64)
    keys, values = (torch.randn(1, 2, past + T, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    _, mask = interleaved_step(past, T, lanes=3)
    visible = step_visibility(mask, past, T, "cpu")
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
    got = attend(q, keys, values, key_layout(visible, past, 2, torch.float64))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stale_slots_past_the_step_do_not_change_a_step(dtype: torch.dtype) -> None:
    """A padded cache hides its unwritten and rolled-back slots instead of zeroing them: they must weigh nothing."""
    model = tiny_model(vocab=50, dtype=dtype)
    tokens = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(3))
    logits = []
    for stale in (0.0, 7.0):
        cache = model.new_cache(40)
        with torch.no_grad():
            model(tokens[:, :17], torch.arange(17), cache)
            cache.commit(17)
            cache.k[:, :, :, 17:] = stale  # as rows of a rejected step would leave them
            cache.v[:, :, :, 17:, :model.config.head_dim] = stale
            logits.append(model(tokens[:, 17:], torch.arange(17, 20), cache))
    assert torch.equal(logits[0], logits[1])


def test_check_catches_a_row_count_dependent_layer() -> None:
    model = tiny_model(vocab=50)
    assert make_exact(model).exact
    layer = model.layers[1].feed_forward.w_down

    class Drifting(torch.nn.Module):  # a kernel whose rows change with the call's row count, as BLAS ones can
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return layer(x) * (1 + 1e-3 * (x.numel() // x.shape[-1] > 1))

    model.layers[1].feed_forward.w_down = Drifting()
    assert not check_invariance(model)


def test_split_tiles_give_the_rows_of_one_tile() -> None:
    weight = torch.randn(24, 16, generator=torch.Generator().manual_seed(2))
    calls = []

    def kernel(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x @ weight.T

    x = torch.randn(2, 5, 16)
    got = tiled_matmul(x, kernel, RowTiling(4, split=True))
    assert calls == [4, 4, 4] and got.shape == (2, 5, 24)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-6, atol=1e-6)
    calls.clear()
    tiled_matmul(x[:, :1], kernel, RowTiling(8))
    assert calls == [8]


def test_find_tiling_probes_a_random_weight_not_the_real_one(monkeypatch) -> None:
    """A kernel that rounds one-row calls its own way must be caught even where the model's real weight would hide
    it (here: all zeros, whose products add up exactly in any order). Seen on an AVX512-BF16 CPU: bfloat16's
    one-row kernel passed a probe with the real weight and then rounded rows of the real model differently."""

    def kernel_for(weight: torch.Tensor, bias, packed):
        def kernel(x: torch.Tensor) -> torch.Tensor:
            exact = x.double() @ weight.double().T
            return (exact * (1 + 2.0 ** -10) if x.shape[0] == 1 else exact).to(x.dtype)  # one row: other rounding
        return kernel

    monkeypatch.setattr(invariance, "linear_kernel", kernel_for)
    assert find_tiling(torch.zeros(48, 32), packed=False) == RowTiling(2)  # float32: one row would be allowed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_weights_never_run_one_row_on_the_cpu(dtype: torch.dtype) -> None:
    """A one-row bfloat16 call can round some real inputs as no wider call does (AMX Xeon) though the probe's
    random inputs agree: such weights get at least REDUCED_MIN_ROWS rows whatever the probe finds."""
    tiling = find_tiling(torch.zeros(48, 32, dtype=dtype), packed=False)
    assert tiling is not None and tiling.rows >= invariance.REDUCED_MIN_ROWS


def test_make_exact_keeps_its_findings_in_a_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "invariance.json"
    first = make_exact(tiny_model(vocab=50), path)
    assert first.exact and path.is_file()
    import minilade.device as device

    monkeypatch.setattr(device, "check_invariance", lambda *a, **k: pytest.fail("checked again"))
    model = tiny_model(vocab=50)
    again = make_exact(model, path)
    assert again == first and isinstance(again, Invariance)
    assert all(isinstance(m, RowTiledLinear) for m in (model.output, model.layers[0].attention.wqkv))
    assert model.output.weight is model.tok_embeddings.weight  # tied weights stay tied


@pytest.mark.parametrize("settings", [(4, 4, 4), (7, 5, 7), (1, 2, 3), (3, 3, 1)])
def test_greedy_lookahead_equals_autoregressive_in_bfloat16(settings) -> None:
    for seed, prompt in [(2, [1, 2, 3, 1, 2, 3, 4]), (5, [7, 3, 3, 9, 1, 7, 3])]:
        model = tiny_model(vocab=12, seed=seed, dtype=torch.bfloat16)
        assert make_exact(model).exact
        expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=60)
        got, run = run_tokens(model, prompt, Lookahead(*settings), max_new_tokens=60)
        assert got == expected
        assert run.stats.compression > 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sliding_window_rows_are_invariant(dtype: torch.dtype) -> None:
    """A window (7) shorter than the contexts and the steps: a row still counts the keys older than its window,
    weighing them 0, so its chunks are those of a one-row step at its position; lookahead stays exact."""
    config = ModelConfig.preset("tiny-gqa").replace(vocab_size=12, sliding_window=7)
    model = Transformer(config).init_random(seed=2, std=0.3).to(dtype).eval()
    assert make_exact(model).exact
    for contexts, width, lanes in [((1, 63, 64), 8, 2), ((5, 130), 40, 8), ((70,), 64, 3)]:
        assert check_invariance(model, contexts, width, lanes), (contexts, width, lanes)
    prompt = [1, 2, 3, 1, 2, 3, 4]
    expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=90)
    for settings in [(4, 4, 4), (7, 5, 7)]:
        got, run = run_tokens(model, prompt, Lookahead(*settings), max_new_tokens=90)
        assert got == expected, settings
        assert run.stats.compression > 1.0
