"""GGUF 4-bit blocks as torch int4 weights (minilade.checkpoints.gguf_quant): bit-exact where the formats map
(Q4_0, Q4_1), through the Q/K un-permutation and the fused projections; refused where they do not (Q8_0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from minilade.checkpoints import meta_model, open_checkpoint
from minilade.checkpoints.gguf import open_gguf
from minilade.checkpoints.gguf_quant import (
    INT4_TYPES,
    bfloat16_exact_fraction,
    exact_zero_points,
    gguf_embedding,
    gguf_int4_weights,
    int4_from_blocks,
    int8_from_q8_0,
)
from minilade.loading import gguf_codes
from minilade.quant import QuantizedLinear, linear_modules, quantize_linears

INT4 = sorted(INT4_TYPES, key=lambda q: q.name)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_blocks_dequantize_bitwise_as_gguf(qtype: QType) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 256)) * 0.05 + rng.uniform(-0.05, 0.05, (48, 1))).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    weight = int4_from_blocks(data, qtype)
    assert weight.group_size == 32 and exact_zero_points(data, qtype)
    assert np.array_equal(bits(weight.dequantize()), gguf.quants.dequantize(data, qtype).view(np.uint32))


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_float32_kernel_computes_with_the_files_weights_bitwise(qtype: QType) -> None:
    rng = np.random.default_rng(1)
    data = gguf.quants.quantize((rng.standard_normal((64, 128)) * 0.05).astype(np.float32), qtype)
    layer = QuantizedLinear(int4_from_blocks(data, qtype), kernel_dtype=torch.float32)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    # Equal values are equal bits, but for zeros: the kernel's sums start at +0.0, so a -0.0 weight reads +0.0.
    assert torch.equal(layer(torch.eye(128)).T, want)


def test_bfloat16_scales_are_not_exact_in_general() -> None:
    """The fast kernels keep scales in bfloat16 (8 significant bits): most float16 scales change."""
    rng = np.random.default_rng(2)
    data = gguf.quants.quantize((rng.standard_normal((64, 128)) * 0.05).astype(np.float32), QType.Q4_1)
    assert bfloat16_exact_fraction(int4_from_blocks(data, QType.Q4_1)) < 0.5


def test_q8_0_has_no_int4_mapping() -> None:
    data = gguf.quants.quantize(np.ones((4, 32), np.float32), QType.Q8_0)
    with pytest.raises(ValueError, match="^type Q8_0 has no exact int4 mapping"):
        int4_from_blocks(data, QType.Q8_0)


def test_q8_0_blocks_are_int8_groups_bitwise() -> None:
    rng = np.random.default_rng(3)
    data = gguf.quants.quantize((rng.standard_normal((24, 96)) * 0.05).astype(np.float32), QType.Q8_0)
    weight = int8_from_q8_0(data)
    assert weight.group_size == 32 and weight.codes.shape == (24, 96)
    assert np.array_equal(bits(weight.dequantize()), gguf.quants.dequantize(data, QType.Q8_0).view(np.uint32))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # Q/K rows permuted by llama.cpp's converter, or not
@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied", "gqa-bias"])
@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_model_weights_from_blocks_equal_the_loaded_float_weights(
        name: str, qtype: QType, arch: str, tmp_path: Path, tiny_llama: Callable[..., Any],
        gguf_tensors: Callable[..., Any], write_gguf: Callable[..., Path]) -> None:
    """Un-permuted Q/K rows (in 'llama' files) and fused projections: every linear module's int4 weight
    dequantizes to exactly the float weight the float loader builds from the same file."""
    hf = tiny_llama(name)
    path = write_gguf(tmp_path / f"{name}.gguf", hf.config, gguf_tensors(hf, qtype, arch), arch=arch)
    model = open_checkpoint(path, progress=False).load_model(dtype=torch.float32, device="cpu")
    linears = {n: m for n, _, _, m in linear_modules(model)}
    weights = gguf_int4_weights(open_gguf(path), linears)
    assert set(weights) == set(linears) - ({"output"} if hf.config.tie_word_embeddings else set())
    for module, weight in weights.items():
        assert torch.equal(weight.dequantize(), linears[module].weight), module


@pytest.mark.parametrize("quantize, group_size", [("int8", 32), ("int4", 64), ("int4", 32)])
def test_file_codes_taken_for_the_embedding_always_and_for_int4_layers_in_groups_of_32(
        quantize: str, group_size: int, tmp_path: Path, tiny_llama: Callable[..., Any],
        gguf_tensors: Callable[..., Any], write_gguf: Callable[..., Path]) -> None:
    hf = tiny_llama("mha-untied")
    tensors = {**gguf_tensors(hf, QType.Q4_0), "token_embd.weight": gguf_tensors(hf, QType.Q8_0)["token_embd.weight"]}
    checkpoint = open_checkpoint(write_gguf(tmp_path / "m.gguf", hf.config, tensors), progress=False)
    model = checkpoint.load_model(dtype=torch.float32, device="cpu")
    blocks = gguf_codes(checkpoint, model, hf.config.vocab_size, quantize, group_size)
    linears = {n for n, *_ in linear_modules(model)}
    assert set(blocks) == {"tok_embeddings"} | (linears if (quantize, group_size) == ("int4", 32) else set())
    assert torch.equal(blocks["tok_embeddings"].dequantize(), model.tok_embeddings.weight)


def test_real_model_blocks_are_bit_exact(smollm2_gguf: Path) -> None:
    """The default checkpoint (Q4_1 layers, Q8_0 tied embedding): every Q4_1 tensor maps exactly, and layer 0's
    fused, un-permuted projections equal the float loader's weights."""
    source = open_gguf(smollm2_gguf)
    tensors = [t for t in source.by_name.values() if t.tensor_type in INT4_TYPES]
    assert len(tensors) == 7 * source.config.n_layers
    assert all(exact_zero_points(t.data, t.tensor_type) for t in tensors[:14])
    model = open_checkpoint(smollm2_gguf, progress=False).load_model(dtype=torch.float32, device="cpu")
    weights = gguf_int4_weights(source, [name for name, *_ in linear_modules(model)])
    assert "output" not in weights  # tied to the Q8_0 embedding
    layer = model.layers[0]
    for module, ours in [("attention.wqkv", layer.attention.wqkv), ("feed_forward.w_gate_up",
                                                                     layer.feed_forward.w_gate_up)]:
        assert torch.equal(weights[f"layers.0.{module}"].dequantize(), ours.weight), module
    embedding = gguf_embedding(source)  # the Q8_0 embedding, code for code
    assert torch.equal(embedding.dequantize(), model.tok_embeddings.weight)


@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied"])
def test_layers_given_as_file_codes_are_never_read_as_floats(
        name: str, tmp_path: Path, tiny_llama: Callable[..., Any], gguf_tensors: Callable[..., Any],
        write_gguf: Callable[..., Path]) -> None:
    """LLM.load's int4 path: the layers that take the file's Q4 codes are neither read nor allocated as floats
    (they stay on the meta device until their codes replace them), and the model built that way equals, tensor for
    tensor, the one whose float layers were loaded first and then replaced by the same codes."""
    hf = tiny_llama(name)
    checkpoint = open_checkpoint(write_gguf(tmp_path / "m.gguf", hf.config, gguf_tensors(hf, QType.Q4_0)),
                                 progress=False)
    blocks = gguf_codes(checkpoint, meta_model(checkpoint.config), hf.config.vocab_size, "int4", 32)
    given = {f"{module}.weight" for module in blocks if module != "tok_embeddings"}
    assert {"layers.0.attention.wqkv.weight", "layers.1.feed_forward.w_down.weight"} <= given
    assert ("output.weight" in given) == (not hf.config.tie_word_embeddings)
    read = {n for n, _ in checkpoint.tensors(given)}
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "up_proj.weight")) for n in read)
    assert "model.embed_tokens.weight" in read and "model.norm.weight" in read

    direct = checkpoint.load_model(dtype=torch.float32, device="cpu", given=given)
    assert {n for n, p in direct.named_parameters() if p.is_meta} == given
    floats = checkpoint.load_model(dtype=torch.float32, device="cpu")
    for model in (direct, floats):
        quantize_linears(model, "int4", 32, weights=blocks)
    a, b = direct.state_dict(), floats.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(t.is_meta for t in a.values())


def test_non_finite_q4_scales_are_refused(tmp_path: Path, tiny_llama: Callable[..., Any],
                                          gguf_tensors: Callable[..., Any], write_gguf: Callable[..., Path],
                                          assert_one_line_error: Callable[..., str]) -> None:
    """Codes taken as they are skip the float loader's finite check, so a corrupted block's scale is caught here."""
    hf = tiny_llama("mha-untied")
    tensors = gguf_tensors(hf, QType.Q4_0)
    data, kind = tensors["blk.1.ffn_up.weight"]
    data = data.copy()
    data[2, 0:2] = [0x00, 0x7E]  # the first block's float16 scale of row 2 becomes NaN
    tensors["blk.1.ffn_up.weight"] = (data, kind)
    path = write_gguf(tmp_path / "m.gguf", hf.config, tensors)
    assert_one_line_error(lambda: gguf_int4_weights(open_gguf(path), ["layers.1.feed_forward.w_gate_up"]),
                          str(path), "tensor model.layers.1.mlp.up_proj.weight (blk.1.ffn_up.weight in the file) "
                          "holds NaN or infinite values")
