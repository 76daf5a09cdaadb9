"""Weight-only quantized linear layers (minilade.quant): round trips, the kernels against the weights they claim,
bounds against float references, row invariance, memory, exact lookahead on quantized tiny models, bad options."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from minilade import quant
from minilade.config import ModelConfig
from minilade.decoding import Autoregressive, Lookahead
from minilade.model import Transformer
from minilade.quant import (
    Int4Weight,
    Int8GroupWeight,
    Int8Weight,
    QuantizedEmbedding,
    QuantizedLinear,
    cat_rows,
    map_rows,
    pack_int4,
    quantize_embedding,
    quantize_linears,
    quantize_weight,
    weight_bytes,
)
from tests.helpers import run_tokens, tiny_model

MODES = ["int8", "int4"]
WIDE = list(range(2, 17)) + [24, 31, 32, 33, 48, 63, 64]


def random_weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 0.05 * torch.randn(n, k, generator=gen) + 0.01 * torch.rand(n, 1, generator=gen)  # rows off-centre


def random_rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_within_half_a_step(scale_dtype: torch.dtype) -> None:
    w = random_weight()
    q = Int8Weight.from_float(w, scale_dtype)
    assert q.codes.dtype == torch.int8 and int(q.codes.abs().max()) <= 127
    assert torch.equal(q.scales.to(scale_dtype).float(), q.scales)  # representable in the kernel's dtype
    # The largest weight of a row may round its scale down, so bound by half a step plus the scale's rounding.
    slack = 2 ** -8 if scale_dtype == torch.bfloat16 else 1e-6
    error = (q.dequantize() - w).abs()
    assert (error <= q.scales[:, None] * 0.5 + w.abs() * slack).all()


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int4_round_trip_within_half_a_step(group_size: int, scale_dtype: torch.dtype) -> None:
    w = random_weight()
    q = Int4Weight.from_float(w, group_size, scale_dtype)
    assert q.group_size == group_size and q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    error = (q.dequantize() - w).abs().view(96, -1, group_size)
    step = q.scales[..., None]
    # float32: half a step; bfloat16: the rounded zero point may also move a group's ends by its rounding.
    slack = 0.0 if scale_dtype == torch.float32 else 2 ** -8 * (q.zeros.abs()[..., None] + 8 * step)
    assert (error <= 0.5 * step * (1 + 1e-5) + slack).all()


def float64_dequantize(q: Int4Weight) -> torch.Tensor:
    signed = (q.codes.double() - 8).view(q.codes.shape[0], -1, q.group_size)
    return (signed * q.scales[..., None].double() + q.zeros[..., None].double()).view(q.codes.shape).float()


def test_int4_dequantize_in_float32_gives_the_float64_bits() -> None:
    """Where every scale x (code - 8) is exact in float32, dequantize computes there: the bits must be the float64
    sum rounded once, over zero points of full precision, -0.0, subnormal and huge scales, far-apart terms."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.uint8)
    scales = (torch.randn(64, 4, generator=g) * 0.05).to(torch.float16).float()  # GGUF's: 11 significant bits
    scales[0, 0], scales[1, 1], scales[2, 2] = 2.0 ** -140, 2.0 ** 120, -(2.0 ** -20) * 1023
    zeros = torch.randn(64, 4, generator=g) * 0.1
    zeros[3], zeros[4, 0], zeros[5, 1] = -0.0, 1e30, 1e-30
    q = Int4Weight(codes, scales, zeros)
    assert quant._products_exact(q.scales)
    assert torch.equal(q.dequantize().view(torch.int32), float64_dequantize(q).view(torch.int32))
    full = Int4Weight(codes, torch.rand(64, 4, generator=g) + 0.5, zeros)  # 24 significant bits: the float64 path
    assert not quant._products_exact(full.scales)
    assert torch.equal(full.dequantize().view(torch.int32), float64_dequantize(full).view(torch.int32))


@pytest.mark.parametrize("mode", MODES)
def test_kernel_multiplies_by_the_dequantized_weight_bitwise(mode: str) -> None:
    """With float32 scales the kernels' scalar path computes an identity input exactly: its output is the
    weight the kernel uses, which must be dequantize() bit for bit."""
    q = quantize_weight(random_weight(), mode, 32, torch.float32)
    layer = QuantizedLinear(q, kernel_dtype=torch.float32)
    assert torch.equal(layer(torch.eye(128)).T, q.dequantize())


@pytest.mark.parametrize("rows", [64, 128, 192])
def test_int4_packed_in_row_blocks_equals_the_whole_matrix_packed(rows: int) -> None:
    """Packing in blocks (to bound the int32 copy while loading) gives the kernel's layout of the whole matrix;
    the last block may be a 16-row remainder. (Blocks of 32 or 96 rows do on an AVX2 CPU, not on an AVX-512 one.)"""
    codes = torch.randint(0, 16, (208, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    assert torch.equal(pack_int4(codes, rows), whole)
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_int4(codes, rows - 32)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_kernel_within_bound_of_float_reference(mode: str) -> None:
    """Against a float64 matmul of the bfloat16-rounded input by the kernel's weight: only the float32
    accumulation and the output's rounding to bfloat16 remain, at most 2^-8 relative plus 2^-16 of the sum of
    absolute products (measured about 2^-9 and far below the second term)."""
    q = quantize_weight(random_weight(), mode, 32)
    layer = QuantizedLinear(q)
    x = random_rows(16, 128)
    xr = x.bfloat16().double()
    w = layer.kernel_weight(q).double()
    ref = xr @ w.T
    bound = 2 ** -8 * ref.abs() + 2 ** -16 * (xr.abs() @ w.abs().T)
    assert ((layer(x).double() - ref).abs() <= bound).all()
    assert layer(x).dtype == torch.float32 and layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("kernel_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_rows_do_not_depend_on_how_many_rows_the_call_has(mode: str, kernel_dtype: torch.dtype) -> None:
    layer = QuantizedLinear(quantize_weight(random_weight(), mode, 32, kernel_dtype), kernel_dtype=kernel_dtype)
    x = random_rows(64, 128)
    one_by_one = torch.cat([layer(x[i:i + 1]) for i in range(64)])
    for m in WIDE:
        assert torch.equal(layer(x[:m]), one_by_one[:m]), f"{m} rows"
        assert torch.equal(layer(x[64 - m:]), one_by_one[64 - m:]), f"last {m} rows"


def test_dense_copy_serves_wide_calls_only() -> None:
    q = quantize_weight(random_weight(), "int4", 32)
    mixed = QuantizedLinear(q, dense_from_rows=8)
    plain = QuantizedLinear(q)
    x = random_rows(8, 128)
    assert torch.equal(mixed(x[:7]), plain(x[:7]))
    assert torch.equal(mixed(x), F.linear(x, mixed.kernel_weight(q)))


def test_rows_maps_and_stacks_every_tensor() -> None:
    a, b = (quantize_weight(random_weight(seed=s), "int4", 32) for s in (0, 1))
    stacked = cat_rows([a, b])
    assert torch.equal(stacked.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    flipped = map_rows(a, lambda t: t.flip(0))
    assert torch.equal(flipped.dequantize(), a.dequantize().flip(0))


def test_quantize_linears_swaps_every_linear_and_reports_memory() -> None:
    model = tiny_model(preset="tiny-mha")  # dim 32, intermediate 64: every in_features a multiple of 32
    embedding = model.tok_embeddings.weight.clone()
    before = weight_bytes(model)
    shapes = [tuple(m.weight.shape) for m in (model.layers[0].attention.wqkv, model.output)]
    quantize_linears(model, "int4", 32)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * model.config.n_layers + 1
    assert torch.equal(model.tok_embeddings.weight, embedding)
    assert (model.layers[0].attention.wqkv.out_features, model.layers[0].attention.wqkv.in_features) == shapes[0]
    # int4: half a byte a weight plus a bfloat16 scale and zero point per group of 32, and the group size as a
    # tensor (int64) the kernel takes.
    quantized = sum(m.out_features * m.in_features * (0.5 + 4 / 32) + 8 for m in layers)
    floats = sum(m.out_features * m.in_features * 4 for m in layers)
    assert weight_bytes(model) == before - floats + quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_greedy_lookahead_equals_autoregressive_under_quantized_weights(mode: str, dtype: torch.dtype) -> None:
    model = quantize_embedding(quantize_linears(tiny_model(preset="tiny-mha", seed=3, dtype=dtype), mode, 32))
    prompt = [1, 2, 3, 4, 1, 2, 3]
    plain, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=40)
    ahead, run = run_tokens(model, prompt, Lookahead(window=4, ngram=3, guesses=4), max_new_tokens=40)
    assert ahead == plain
    assert run.stats.steps < 39  # lookahead accepted drafts, so wide steps computed tokens too


def test_quantized_model_differs_from_float_only_slightly() -> None:
    """A guard that the layers are wired right (not merely invariant): logits of the int8 model are close to
    the float model's on the same tokens."""
    model = tiny_model(preset="tiny-mha", std=0.1)
    quantized = quantize_linears(copy.deepcopy(model), "int8", 32)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = model(tokens, torch.arange(5), model.new_cache(8))
        got = quantized(tokens, torch.arange(5), quantized.new_cache(8))
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_int8_groups_round_trip_within_half_a_step_and_look_rows_up() -> None:
    w = random_weight(n=40, k=96)
    q = Int8GroupWeight.from_float(w, group_size=32)
    assert q.codes.dtype == torch.int8 and q.scales.shape == (40, 3) and q.group_size == 32
    assert torch.equal(q.scales, q.scales.half().float())  # scales are float16 values, as in GGUF's Q8_0
    step = q.scales.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 * (1 + 1e-6)).all()
    index = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(q.rows(index), q.dequantize()[index])
    with pytest.raises(ValueError, match="^int8 groups need a width divisible by group_size; got 96 and 64$"):
        Int8GroupWeight.from_float(w, group_size=64)


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_embedding_looks_up_the_dequantized_rows_and_frees_the_float_matrix(tied: bool) -> None:
    """The model with a quantized embedding computes exactly as the float model whose embedding is the dequantized
    matrix; the float matrix is gone (for a tied head, once the head is quantized); the scales stay float32 when
    the model changes dtype."""
    config = ModelConfig.preset("tiny-mha").replace(vocab_size=64, tie_word_embeddings=tied)
    model = quantize_linears(Transformer(config).init_random(std=0.1).eval(), "int8")
    reference = copy.deepcopy(model)
    before = weight_bytes(model)
    quantize_embedding(model)
    embedding = model.tok_embeddings
    assert isinstance(embedding, QuantizedEmbedding)
    with torch.no_grad():
        reference.tok_embeddings.weight.copy_(Int8GroupWeight(embedding.codes, embedding.scales).dequantize())
    tokens = torch.tensor([[1, 2, 3, 60, 5]])
    with torch.no_grad():
        got = model(tokens, torch.arange(5), model.new_cache(8))
        want = reference(tokens, torch.arange(5), reference.new_cache(8))
    assert torch.equal(got, want)
    V, D = embedding.codes.shape
    assert weight_bytes(model) == before - V * D * 4 + V * D + V * (D // 32) * 4
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.tok_embeddings.scales.dtype == torch.float32
    assert model(tokens, torch.arange(5), model.new_cache(8)).dtype == torch.bfloat16


@pytest.mark.parametrize("options, fragment", [
    (dict(mode="int3"), "unknown quantization 'int3'; choose from int8, int4"),
    (dict(group_size=16), "group_size must be one of 32, 64, 128, 256; got 16"),
    (dict(kernel_dtype=torch.float16), "kernel_dtype must be bfloat16 or float32"),
])
def test_bad_options_are_one_line_value_errors(options: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        quantize_linears(tiny_model(preset="tiny-mha"), **options)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_indivisible_layer_and_non_cpu_model_are_named() -> None:
    model = tiny_model(preset="tiny-gqa")  # dim 48
    with pytest.raises(ValueError, match=r"^[\w.]+: int4 needs in_features divisible by group_size; got 48 and 32$"):
        quantize_linears(model, "int4", 32)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # nothing half-swapped
    model = tiny_model(vocab=40, preset="tiny-mha")  # dim 32, but a head of 40 rows the int4 packing cannot take
    with pytest.raises(ValueError, match=r"^output: int4 needs out_features divisible by 16 \(the kernel's packing\); "
                                         r"got 40$"):
        quantize_linears(model, "int4", 32)
    model = tiny_model(preset="tiny-mha").to("meta")
    with pytest.raises(ValueError, match=r"^quantized layers run on the CPU only; [\w.]+ is on meta$"):
        quantize_linears(model, "int8")
