"""w7a8 layers (minilade.integer_linear): the integer arithmetic they claim, bit for bit, rows independent of the
call, exact lookahead on a w7a8 tiny model, closeness to the float model, loading, the measured choice between
int4 and w7a8 (device.choose_quantization) and bad options."""

from __future__ import annotations

import copy
import gc
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minilade import device, integer_linear, native, quant
from minilade.decoding import Autoregressive, Lookahead
from minilade.device import Invariance
from minilade.integer_linear import (
    ACTIVATION_LEVELS,
    TINY,
    WEIGHT_LEVELS,
    W7A8Linear,
    w7a8_codes,
    w7a8_missing,
)
from minilade.quant import Int4Weight, QuantizedEmbedding, quantize_embedding, quantize_linears, weight_bytes
from tests.helpers import run_tokens, tiny_model

pytestmark = pytest.mark.skipif(w7a8_missing() is not None, reason=f"no w7a8 kernel: {w7a8_missing()}")


def hostile_weight(n: int = 48, k: int = 96, seed: int = 0) -> torch.Tensor:
    """Random rows, plus rows of one sign at full scale: with 8-bit weights these would overflow the kernel's
    16-bit pair sums against full-scale activations (2 x 255 x 127 > 32767)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[0], w[1] = 1.0, -1.0
    w[2, ::2], w[2, 1::2] = 1.0, -1.0
    return w


def hostile_rows(m: int, k: int = 96, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen).float())
    x[0], x[1] = 3.0, -3.0
    x[2, ::2], x[2, 1::2] = 2.0, -2.0
    x[3] = 0.0
    return x


def test_codes_rounded_in_blocks_are_the_whole_weights_rounding(monkeypatch) -> None:
    """w7a8_codes rounds a weight a block of rows at a time: the codes of round-to-nearest over the whole weight at
    once, whatever the block, from float32, bfloat16 or float64 weights."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        w = hostile_weight(n=50, k=96).to(dtype)
        largest = w.float().abs().amax(dim=1)
        scales = (largest / WEIGHT_LEVELS).clamp_min(TINY)
        want = (w.float() / scales[:, None]).round().clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
        for block in (96, 7 * 96, 96 * 96, 1 << 21):  # one row, a part that leaves a remainder, more than all
            monkeypatch.setattr(integer_linear, "ROUNDING_BLOCK", block)
            codes, got_scales = w7a8_codes(w)
            assert torch.equal(codes, want) and torch.equal(got_scales, scales), (dtype, block)


def test_layers_pack_their_codes_for_fbgemm_only_when_they_first_run_through_it(monkeypatch) -> None:
    """A w7a8 layer holds its codes until it runs through fbgemm, which packs them then (or pack_layers, for a whole
    model on several threads): the same results either way, the codes read back from the packing."""
    packs = []
    pack = integer_linear.pack_weight
    monkeypatch.setattr(integer_linear, "pack_weight", lambda *args: packs.append(1) or pack(*args))
    weights, x = [hostile_weight(n=16 * (1 + i % 3), seed=i) for i in range(5)], hostile_rows(5)
    lazy, together = [W7A8Linear(w) for w in weights], torch.nn.Sequential(*[W7A8Linear(w) for w in weights])
    codes = [layer.weight_codes() for layer in lazy]
    assert not packs and all(layer.unpacked for layer in lazy)
    outputs = [layer(x) for layer in lazy]
    assert len(packs) == len(weights) and not any(layer.unpacked for layer in lazy)
    integer_linear.pack_layers(together)
    assert len(packs) == 2 * len(weights) and not any(layer.unpacked for layer in together)
    for layer, out, (c, s) in zip(together, outputs, codes):
        assert torch.equal(layer(x), out)
        read_codes, read_scales = layer.weight_codes()
        assert torch.equal(read_codes, c) and torch.equal(read_scales, s)
    assert len(packs) == 2 * len(weights)  # packed once each


def test_a_dtype_conversion_before_packing_keeps_the_float32_scales() -> None:
    """A layer converted to another dtype before it first ran (`model.to(torch.bfloat16)`: its scales buffer then
    rounded) still packs its codes with their float32 scales: the same results as a layer never converted."""
    w, x = hostile_weight(), hostile_rows(5)
    layer = W7A8Linear(w).to(torch.bfloat16)
    assert layer.unpacked and layer.weight_scales.dtype == torch.bfloat16
    assert torch.equal(layer(x), W7A8Linear(w)(x))
    assert layer.weight_codes()[1].dtype == torch.float32


def test_layer_is_the_integer_product_of_the_codes_bitwise() -> None:
    w, x = hostile_weight(), hostile_rows(40)
    layer = W7A8Linear(w)
    codes, scales = w7a8_codes(w)
    assert codes.abs().max() == WEIGHT_LEVELS
    read_codes, read_scales = layer.weight_codes()
    assert torch.equal(read_codes, codes) and torch.equal(read_scales, scales)
    row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / ACTIVATION_LEVELS
    integers = torch.round(x / row_scale).long()
    assert integers.abs().max() == ACTIVATION_LEVELS
    want = ((integers @ codes.long().T).float() * scales) * row_scale
    assert torch.equal(layer(x), want)
    assert torch.equal(layer(x[3:4]), torch.zeros(1, 48))  # a zero row stays zero (no 0/0)


def test_rows_do_not_depend_on_how_many_rows_the_call_has() -> None:
    layer, x = W7A8Linear(hostile_weight(k=1536)), hostile_rows(64, k=1536)
    whole = layer(x)
    for m in list(range(1, 17)) + [31, 32, 33, 63]:
        for at in (0, 64 - m):
            assert torch.equal(layer(x[at:at + m]), whole[at:at + m]), (m, at)


def test_bias_and_dtypes_round_trip() -> None:
    w, bias, x = hostile_weight(), torch.randn(48), hostile_rows(5)
    layer = W7A8Linear(w, bias)
    assert torch.equal(layer(x), W7A8Linear(w)(x) + bias)
    assert layer(x.bfloat16().view(5, 1, 96)).dtype == torch.bfloat16
    assert layer(x.view(5, 1, 96)).shape == (5, 1, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_lookahead_equals_autoregressive_under_w7a8(dtype: torch.dtype) -> None:
    model = quantize_embedding(quantize_linears(tiny_model(preset="tiny-mha", seed=3, dtype=dtype), "w7a8"))
    assert sum(isinstance(m, W7A8Linear) for m in model.modules()) == 4 * model.config.n_layers + 1
    prompt = [1, 2, 3, 4, 1, 2, 3]
    plain, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=40)
    ahead, run = run_tokens(model, prompt, Lookahead(window=4, ngram=3, guesses=4), max_new_tokens=40)
    assert ahead == plain
    assert run.stats.steps < 39  # wide steps computed tokens too


def test_w7a8_model_is_close_to_the_float_model_and_smaller() -> None:
    model = tiny_model(preset="tiny-gqa", std=0.1)  # dim 48: no group constraint for w7a8
    quantized = quantize_linears(copy.deepcopy(model), "w7a8")
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = model(tokens, torch.arange(5), model.new_cache(8))
        got = quantized(tokens, torch.arange(5), quantized.new_cache(8))
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # 7-bit weights: 3.5% measured; miswired: ~100%
    layers = [m for m in quantized.modules() if isinstance(m, W7A8Linear)]
    floats = sum(m.out_features * m.in_features * 4 for m in layers)
    if model.output.weight is model.tok_embeddings.weight:  # a tied head's floats stay, as the embedding
        floats -= model.output.weight.numel() * 4
    packed = sum(m.out_features * (m.in_features + 4) for m in layers)
    assert weight_bytes(quantized) == weight_bytes(model) - floats + packed


def test_given_int4_codes_are_taken_by_their_values() -> None:
    """A GGUF file's Q4 layers reach w7a8 as Int4Weight codes, never read as floats: the layer rounds their
    dequantized values, as it would the same floats."""
    model = tiny_model(preset="tiny-mha")
    name = "layers.0.feed_forward.w_down"
    given = Int4Weight.from_float(model.get_submodule(name).weight, 32)
    quantize_linears(model, "w7a8", weights={name: given})
    codes, _ = model.get_submodule(name).weight_codes()
    assert torch.equal(codes, w7a8_codes(given.dequantize())[0])


def test_the_graph_operator_is_the_layers_kernel_call() -> None:
    """Inside a compiled graph the layer's matmul is minilade::w7a8_matmul, which finds the layer by its scales once
    its codes are packed (compiled.compile_steps packs them before any graph runs; tests/decoding/test_compiled.py
    compiles it), whichever body the operator has in this process; a layer no longer in use leaves the operator's
    registry."""
    layer, x = W7A8Linear(hostile_weight()), hostile_rows(5)
    integer_linear.pack_layers(layer)
    scale = x.abs().amax(-1, keepdim=True).clamp_min_(TINY).div_(ACTIVATION_LEVELS)
    codes = x.div(scale).round_()
    assert torch.equal(torch.ops.minilade.w7a8_matmul(codes, layer.weight_scales).mul_(scale), layer(x))
    key = layer.weight_scales.data_ptr()
    assert integer_linear._LAYERS[key] is layer
    copied = copy.deepcopy(layer)
    assert integer_linear._LAYERS[copied.weight_scales.data_ptr()] is copied
    assert torch.equal(torch.ops.minilade.w7a8_matmul(codes, copied.weight_scales).mul_(scale), layer(x))
    copied.to(torch.float64)  # a new scales buffer: found under its storage too
    assert integer_linear._LAYERS[copied.weight_scales.data_ptr()] is copied
    del layer
    gc.collect()
    assert key not in integer_linear._LAYERS


def test_the_graph_operators_cpp_body_gives_the_kernels_bits_and_forgets_a_layer_that_goes() -> None:
    """integer_linear.load_native_matmul: where ninja and a C++ compiler are at hand, the operator's C++ body replaces
    the Python one (in this process from then on): once a layer packed its codes (compiled.compile_steps packs a
    model's before any graph runs), the bits of the layer's own kernel call, for a copy with a moved scales buffer
    too, and a layer that goes is forgotten (its scales no longer find a weight)."""
    missing = integer_linear.load_native_matmul()
    if missing and missing.startswith("no ninja"):
        pytest.skip(missing)
    assert missing is None and integer_linear._BODY is None
    layer, x = W7A8Linear(hostile_weight()), hostile_rows(5)
    scale = x.abs().amax(-1, keepdim=True).clamp_min_(TINY).div_(ACTIVATION_LEVELS)
    codes = x.div(scale).round_()
    integer_linear.pack_layers(layer)
    want = layer(x)
    assert torch.equal(torch.ops.minilade.w7a8_matmul(codes, layer.weight_scales).mul_(scale), want)
    copied = copy.deepcopy(layer).to(torch.float64)
    assert torch.equal(torch.ops.minilade.w7a8_matmul(codes, copied.weight_scales).mul_(scale), want)
    scales = layer.weight_scales  # held, so that no other tensor takes its address
    del layer
    gc.collect()
    with pytest.raises(RuntimeError, match="no w7a8 layer has these weight scales"):
        torch.ops.minilade.w7a8_matmul(codes, scales)


FAILED_BUILD = """
import torch
from torch.utils import cpp_extension
from minilade import integer_linear
from tests.test_integer_linear import hostile_rows, hostile_weight

def failing_build(**kwargs):
    raise RuntimeError("Error building extension: a test's")

cpp_extension.load = failing_build
print(integer_linear.load_native_matmul())
layer, x = integer_linear.W7A8Linear(hostile_weight()), hostile_rows(5)
scale = x.abs().amax(-1, keepdim=True).clamp_min_(integer_linear.TINY).div_(integer_linear.ACTIVATION_LEVELS)
got = torch.ops.minilade.w7a8_matmul(x.div(scale).round_(), layer.weight_scales).mul_(scale)
print("same bits:", torch.equal(got, layer(x)))
"""


def test_a_cpp_body_that_does_not_build_leaves_the_python_body_in_place() -> None:
    """load_native_matmul in a fresh process whose build fails: it says why in one line, and the operator keeps
    its Python body, which still gives the layer's bits."""
    done = subprocess.run([sys.executable, "-c", FAILED_BUILD], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.strip().splitlines()[-2:]
    assert first in ("the C++ w7a8 operator did not build: Error building extension: a test's",
                     "no ninja to build the C++ w7a8 operator with")
    assert second == "same bits: True"


STALE_LOCK = """
import os, sys
from minilade import integer_linear, native
lock = native.build_folder("w7a8_matmul") / "lock"
lock.parent.mkdir(parents=True)
lock.touch()
old = os.path.getmtime(lock) - native.STALE_BUILD_LOCK_S - 1
os.utime(lock, (old, old))
print(integer_linear.load_native_matmul(), lock.exists())
"""


def test_a_build_lock_left_by_a_killed_build_is_cleared_not_waited_for(tmp_path) -> None:
    """torch.utils.cpp_extension waits forever for a build folder's lock; one older than any build of the C++
    operator was left by a killed build, and load_native_matmul clears it and builds (in a fresh extensions folder,
    in a fresh process)."""
    if shutil.which("ninja") is None:
        pytest.skip("no ninja to build the C++ w7a8 operator with")
    done = subprocess.run([sys.executable, "-c", STALE_LOCK], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1],
                          env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["None", "False"]
    assert re.search(r"minilade: building the C\+\+ w7a8 operator for this machine \(once\)\.\.\. \d+ s\n",
                     done.stderr), done.stderr[-2000:]


def test_an_operator_is_built_where_its_build_is_missing_or_older_than_its_source(tmp_path) -> None:
    """native.built: what decides the line that announces a build (the C++ compiler runs for seconds)."""
    source, header, folder = tmp_path / "op.cpp", tmp_path / "op.h", tmp_path / "build" / "minilade_op"
    source.write_text("")
    header.write_text("")
    folder.mkdir(parents=True)
    assert not native.built(folder, source)
    library = folder / "minilade_op.so"
    library.write_text("")
    assert native.built(folder, source)
    later = library.stat().st_mtime + 10
    os.utime(header, (later, later))
    assert not native.built(folder, source)


def test_missing_kernel_is_a_one_line_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "w7a8_missing", lambda: "no fbgemm here")
    with pytest.raises(ValueError, match=r"^w7a8 cannot run here: no fbgemm here; choose int8 or int4$"):
        quantize_linears(tiny_model(preset="tiny-mha"), "w7a8")


def fake_costs(faster: str):
    """compare_step_costs as if `faster`'s layers stepped in half the time."""
    def compare(models, rows, **_):
        def seconds(model):
            return 1.0 if (faster == "w7a8") == any(isinstance(m, W7A8Linear) for m in model.modules()) else 2.0
        return {name: {r: seconds(model) for r in rows} for name, model in models.items()}
    return compare


@pytest.mark.parametrize("faster", ["int4", "w7a8"])
def test_choose_quantization_takes_the_faster_exact_mode_and_keeps_the_choice(
        faster: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(device, "compare_step_costs", fake_costs(faster))
    check_file = tmp_path / "invariance.json"
    chosen, said = device.choose_quantization(tiny_model(preset="tiny-mha"), {}, ("int4", "w7a8"), check_file)
    assert any(isinstance(m, W7A8Linear) for m in chosen.modules()) == (faster == "w7a8")
    assert isinstance(chosen.tok_embeddings, QuantizedEmbedding) and said.startswith(f"{faster} measured fastest")

    def unmeasured(*_, **__):
        raise AssertionError("a kept choice is not measured again")
    monkeypatch.setattr(device, "compare_step_costs", unmeasured)
    again, _ = device.choose_quantization(tiny_model(preset="tiny-mha"), {}, ("int4", "w7a8"), check_file)
    assert any(isinstance(m, W7A8Linear) for m in again.modules()) == (faster == "w7a8")


def test_choose_quantization_skips_a_mode_that_is_not_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "compare_step_costs", fake_costs("w7a8"))
    real = device.make_exact
    monkeypatch.setattr(device, "make_exact", lambda model, path=None, warn=True: (
        Invariance(False, {}) if any(isinstance(m, W7A8Linear) for m in model.modules())
        else real(model, path, warn=warn)))
    chosen, said = device.choose_quantization(tiny_model(preset="tiny-mha"), {}, ("int4", "w7a8"))
    assert not any(isinstance(m, W7A8Linear) for m in chosen.modules()) and said.startswith("int4")
