"""GGUF files (minilade.checkpoints.gguf): names, dequantisation, Q/K un-permutation, metadata and errors.

Files are written with gguf.GGUFWriter the way llama.cpp's converter writes them (see conftest.py), so the loader
is checked against the original HF-layout tensors and, independently, against transformers' own GGUF loader.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import LlamaForCausalLM

from minilade.checkpoints import (
    UnsupportedCheckpointError,
    expected_tensor_shapes,
    open_checkpoint,
)

TinyLlama = Callable[..., LlamaForCausalLM]
StateOf = Callable[[LlamaForCausalLM], dict[str, torch.Tensor]]
Loaded = Callable[[Path], dict[str, torch.Tensor]]
GGUFTensors = Callable[[LlamaForCausalLM, QType], dict[str, tuple[np.ndarray, QType | None]]]
TinyGGUF = Callable[..., tuple[LlamaForCausalLM, Path]]
KQuantGGUF = Callable[..., tuple[Path, dict[str, np.ndarray]]]
OneLineError = Callable[..., str]
WriteGGUF = Callable[..., Path]


@pytest.fixture
def tiny_gguf(tmp_path: Path, tiny_llama: TinyLlama, gguf_tensors: GGUFTensors, write_gguf: WriteGGUF
              ) -> TinyGGUF:
    """(TINY name, qtype, **write_gguf options) -> the model and its GGUF file."""
    def make(name: str, qtype: QType, **kwargs: Any) -> tuple[LlamaForCausalLM, Path]:
        model = tiny_llama(name)
        path = write_gguf(tmp_path / f"{name}-{qtype.name}.gguf", model.config, gguf_tensors(model, qtype), **kwargs)
        return model, path
    return make


# ---------------------------------------------------------------------------------------------------------------
# GGUF: float and legacy quantised types written with gguf.quants.quantize
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied", "head-dim"])
def test_gguf_float_types_reproduce_the_hf_tensors(name: str, qtype: QType, tiny_gguf: TinyGGUF,
                                                   canonical_state: StateOf) -> None:
    model, path = tiny_gguf(name, qtype)
    checkpoint = open_checkpoint(path, progress=False)
    ours = dict(checkpoint.tensors())
    reference = canonical_state(model)
    assert ours.keys() == reference.keys()
    stored_dtype = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}[qtype]
    for key, tensor in reference.items():
        want = tensor if tensor.ndim == 1 else tensor.to(stored_dtype)  # 1-D tensors are always stored F32
        assert ours[key].dtype == want.dtype and torch.equal(ours[key], want), key
    config = checkpoint.config
    assert checkpoint.format == "gguf"
    assert (config.n_heads, config.n_kv_heads, config.tie_word_embeddings) == (
        model.config.num_attention_heads, model.config.num_key_value_heads, model.config.tie_word_embeddings)
    assert config.head_dim == model.model.layers[0].self_attn.head_dim
    assert config.norm_eps == pytest.approx(1e-5) and config.rope_theta == 10000.0


# Worst-case |error| / max|w| of one round trip: half a step, or a full step where a value clips at the edge of
# a symmetric range (Q4_0, Q5_0), plus float16 rounding of the block scale.
QUANT_TOLERANCE = {QType.Q8_0: 0.006, QType.Q5_1: 0.04, QType.Q5_0: 0.07, QType.Q4_1: 0.075, QType.Q4_0: 0.13}


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied"])
def test_gguf_quantised_types(name: str, qtype: QType, tiny_gguf: TinyGGUF, canonical_state: StateOf,
                              loaded: Loaded) -> None:
    """Exact against the writer's own round trip dequantize(quantize(w)) of the HF-layout tensor (blocks run
    along rows, so quantisation commutes with the Q/K row permutation: this pins names, orientation and the
    un-permutation exactly), and within the quantisation error of the original weights (pins the round trip)."""
    model, path = tiny_gguf(name, qtype)
    ours = loaded(path)
    for key, tensor in canonical_state(model).items():
        if tensor.ndim == 1:
            assert torch.equal(ours[key], tensor), key
            continue
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), qtype), qtype)
        assert ours[key].dtype == torch.float32
        assert torch.equal(ours[key], torch.from_numpy(round_trip)), key
        error = (ours[key] - tensor).abs().max() / tensor.abs().max()
        assert error <= QUANT_TOLERANCE[qtype], (key, error.item())


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied"])
def test_gguf_matches_transformers_gguf_loader(name: str, qtype: QType, tiny_gguf: TinyGGUF, loaded: Loaded) -> None:
    """transformers un-permutes Q/K with its own code; both loaders must agree bit for bit."""
    _, path = tiny_gguf(name, qtype)
    theirs = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    ours = loaded(path)
    assert set(ours) <= set(theirs)
    for key, tensor in ours.items():
        assert torch.equal(tensor.float(), theirs[key]), key


def test_gguf_biases_and_rope_freqs(tmp_path: Path, tiny_llama: TinyLlama, gguf_tensors: GGUFTensors,
                                    write_gguf: WriteGGUF, canonical_state: StateOf) -> None:
    """Q/K biases are permuted by the converter too; rope_freqs feeds config.rope_freq_factors. (transformers'
    GGUF loader reads no bias flags from LLaMA GGUF metadata, so this is checked against the HF model only.)"""
    model = tiny_llama("gqa-bias")
    tensors = gguf_tensors(model, QType.F32)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    factors = np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32)
    tensors["rope_freqs.weight"] = (factors, None)
    path = write_gguf(tmp_path / "bias.gguf", model.config, tensors)

    checkpoint = open_checkpoint(path, progress=False)
    assert checkpoint.config.qkv_bias and checkpoint.config.o_bias and checkpoint.config.mlp_bias
    assert checkpoint.config.rope_freq_factors == tuple(factors.tolist())
    ours = dict(checkpoint.tensors())
    reference = canonical_state(model)
    assert ours.keys() == reference.keys()
    assert "model.layers.1.self_attn.k_proj.bias" in ours
    for key, tensor in reference.items():
        assert torch.equal(ours[key], tensor), key


# ---------------------------------------------------------------------------------------------------------------
# GGUF: k-quants, which gguf.quants cannot produce. Raw blocks are checked against a scalar transcription of the
# dequantize_row_q*_K loops in ggml's ggml-quants.c, independent of gguf-py's vectorised numpy code (which both
# minilade and transformers use), and one Q4_K block against values derived by hand.
# ---------------------------------------------------------------------------------------------------------------

def _f16(raw: np.ndarray) -> np.float32:
    return np.frombuffer(raw.tobytes(), dtype=np.float16)[0].astype(np.float32)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml's get_scale_min_k4: eight 6-bit scales and mins packed into 12 bytes."""
    q = q.astype(int)
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_q2_k(block: np.ndarray) -> np.ndarray:
    scales, qs, d, dmin = block[:16], block[16:80], _f16(block[80:82]), _f16(block[82:84])
    out, next_scale = [], iter(scales.tolist())  # C: scales[is++]
    for n in range(2):
        q = qs[32 * n:32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in (q[:16], q[16:]):
                sc = next(next_scale)
                out.append(d * np.float32(sc & 0xF) * ((half >> shift) & 3).astype(np.float32)
                           - dmin * np.float32(sc >> 4))
    return np.concatenate(out)


def ref_q3_k(block: np.ndarray) -> np.ndarray:
    hmask, qs, d = block[:32], block[32:96], _f16(block[108:110])
    aux = np.frombuffer(block[96:108].tobytes() + bytes(4), dtype=np.uint32).copy()
    kmask1, kmask2, tmp = np.uint32(0x03030303), np.uint32(0x0F0F0F0F), aux[2]
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)
    scales = aux.view(np.int8)
    out, next_scale, m = [], iter(scales.tolist()), 1  # C: scales[is++]
    for n in range(2):
        q = qs[32 * n:32 * n + 32]
        for shift in (0, 2, 4, 6):
            for off in (0, 16):
                dl = d * np.float32(next(next_scale) - 32)
                low = ((q[off:off + 16] >> shift) & 3).astype(np.int8)
                high = np.where(hmask[off:off + 16] & m, 0, 4).astype(np.int8)
                out.append(dl * (low - high).astype(np.float32))
            m <<= 1
    return np.concatenate(out)


def ref_q4_k(block: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _f16(block[0:2]), _f16(block[2:4]), block[4:16], block[16:144]
    out = []
    for j in range(4):
        q = qs[32 * j:32 * j + 32]
        for is_, nibble in ((2 * j, q & 0xF), (2 * j + 1, q >> 4)):
            sc, m = _scale_min_k4(is_, scales)
            out.append(d * np.float32(sc) * nibble.astype(np.float32) - dmin * np.float32(m))
    return np.concatenate(out)


def ref_q5_k(block: np.ndarray) -> np.ndarray:
    d, dmin, scales = _f16(block[0:2]), _f16(block[2:4]), block[4:16]
    qh, qs = block[16:48], block[48:176]
    out, u1, u2 = [], 1, 2
    for j in range(4):
        ql = qs[32 * j:32 * j + 32]
        for is_, low, bit in ((2 * j, ql & 0xF, u1), (2 * j + 1, ql >> 4, u2)):
            sc, m = _scale_min_k4(is_, scales)
            value = low.astype(np.float32) + np.where(qh & bit, 16, 0).astype(np.float32)
            out.append(d * np.float32(sc) * value - dmin * np.float32(m))
        u1, u2 = u1 << 2, u2 << 2
    return np.concatenate(out)


def ref_q6_k(block: np.ndarray) -> np.ndarray:
    ql_all, qh_all, sc_all, d = block[:128], block[128:192], block[192:208].view(np.int8), _f16(block[208:210])
    out = np.empty(256, dtype=np.float32)
    lanes = np.arange(32)
    for n in range(2):
        ql, qh, sc, y = ql_all[64 * n:], qh_all[32 * n:], sc_all[8 * n:], out[128 * n:]
        is_ = lanes // 16
        parts = [
            (ql[lanes] & 0xF) | (((qh[lanes] >> 0) & 3) << 4),
            (ql[lanes + 32] & 0xF) | (((qh[lanes] >> 2) & 3) << 4),
            (ql[lanes] >> 4) | (((qh[lanes] >> 4) & 3) << 4),
            (ql[lanes + 32] >> 4) | (((qh[lanes] >> 6) & 3) << 4),
        ]
        for k, q in enumerate(parts):
            q = q.astype(np.int8) - np.int8(32)
            y[lanes + 32 * k] = d * sc[is_ + 2 * k].astype(np.float32) * q.astype(np.float32)
    return out


KQUANT_REFERENCE = {QType.Q2_K: ref_q2_k, QType.Q3_K: ref_q3_k, QType.Q4_K: ref_q4_k, QType.Q5_K: ref_q5_k,
                    QType.Q6_K: ref_q6_k}
# Byte offsets of the float16 super-block scales (d, and dmin where present) inside each block.
KQUANT_F16_FIELDS = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
                     QType.Q6_K: (208,)}


# The same for the i-quants and ternary types (ggml-common.h's block structs: d first, or last in TQ1_0 / TQ2_0).
# IQ1_M has no float16 field: its scale is spread over the top nibbles of four uint16 scales (see random_blocks).
IQUANT_F16_FIELDS = {QType.IQ1_S: (0,), QType.IQ1_M: (), QType.IQ2_XXS: (0,), QType.IQ2_XS: (0,),
                     QType.IQ2_S: (0,), QType.IQ3_XXS: (0,), QType.IQ3_S: (0,), QType.IQ4_NL: (0,),
                     QType.IQ4_XS: (0,), QType.TQ1_0: (52,), QType.TQ2_0: (64,)}
IQ1_M_SCALES = 48  # byte offset of IQ1_M's four uint16 scales


def random_blocks(qtype: QType, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks for a (rows, cols) tensor, with finite, moderate float16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in {**KQUANT_F16_FIELDS, **IQUANT_F16_FIELDS}[qtype]:
        scale = rng.uniform(0.01, 0.1, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype == QType.IQ1_M:  # d = 0x2E66 (about 0.1): nibbles 6, 6, E, 2 atop scales 0..3
        for i, nibble in enumerate((0x6, 0x6, 0xE, 0x2)):
            byte = raw[..., IQ1_M_SCALES + 2 * i + 1]
            raw[..., IQ1_M_SCALES + 2 * i + 1] = (byte & 0x0F) | (nibble << 4)
    return raw.reshape(shape[0], -1)


def reference_dequantise(qtype: QType, raw: np.ndarray) -> torch.Tensor:
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = [np.concatenate([KQUANT_REFERENCE[qtype](block) for block in row.reshape(-1, type_size)])
            for row in raw]
    return torch.from_numpy(np.stack(rows))


@pytest.fixture
def kquant_gguf(tmp_path: Path, tiny_llama: TinyLlama, gguf_tensors: GGUFTensors, write_gguf: WriteGGUF
                ) -> KQuantGGUF:
    """(qtype, override=None) -> a 1-layer LLaMA GGUF file (dim 256: k-quant blocks hold 256 values) whose matrices
    are random raw blocks (or override[gguf name]), and those raw blocks by GGUF name."""
    def make(qtype: QType, override: dict[str, np.ndarray] | None = None) -> tuple[Path, dict[str, np.ndarray]]:
        model = tiny_llama("gqa-tied", hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
        tensors = gguf_tensors(model, QType.F32)
        rng = np.random.default_rng(int(qtype))
        raw = {}
        for name, (data, _) in tensors.items():
            if data.ndim == 2:
                raw[name] = (override or {}).get(name, random_blocks(qtype, data.shape, rng))
                tensors[name] = (raw[name], qtype)
        return write_gguf(tmp_path / f"{qtype.name}.gguf", model.config, tensors), raw
    return make


@pytest.mark.parametrize("qtype", list(KQUANT_REFERENCE), ids=lambda q: q.name)
def test_gguf_kquants_match_ggml_reference_loops(qtype: QType, kquant_gguf: KQuantGGUF, loaded: Loaded) -> None:
    path, raw = kquant_gguf(qtype)
    ours = loaded(path)
    # attn_q / attn_k are skipped: their rows are un-permuted, which the tests above pin down.
    for gguf_key, canonical in [("token_embd.weight", "model.embed_tokens.weight"),
                                ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
                                ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
                                ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight"),
                                ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),
                                ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight")]:
        want = reference_dequantise(qtype, raw[gguf_key])
        assert ours[canonical].dtype == torch.float32
        torch.testing.assert_close(ours[canonical], want, rtol=0, atol=0, msg=canonical)


@pytest.mark.parametrize("qtype", list(IQUANT_F16_FIELDS), ids=lambda q: q.name)
def test_gguf_iquants_and_ternary_types_load(qtype: QType, kquant_gguf: KQuantGGUF, loaded: Loaded) -> None:
    """The types llama.cpp's quantize writes beyond the k-quants load as gguf-py dequantises them (no independent
    reference here: these pin the plumbing, the block sizes and that no type is refused), and the model runs."""
    path, raw = kquant_gguf(qtype)
    ours = loaded(path)
    for gguf_key, canonical in [("token_embd.weight", "model.embed_tokens.weight"),
                                ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
                                ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight")]:
        want = torch.from_numpy(gguf.quants.dequantize(raw[gguf_key], qtype))
        assert want.abs().max() > 0 and torch.equal(ours[canonical], want), canonical
    checkpoint = open_checkpoint(path, progress=False)
    model = checkpoint.load_model(dtype=torch.float32, device="cpu")
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]), torch.arange(3), model.new_cache(8))
    assert torch.isfinite(logits).all()


def test_gguf_q4_k_block_derived_by_hand(kquant_gguf: KQuantGGUF, loaded: Loaded) -> None:
    """d = 1, dmin = 0.5, every sub-block scale 2 and min 1, every byte 0x53 (low nibble 3, high nibble 5):
    each 64 values are 32 x (1*2*3 - 0.5*1) = 5.5 then 32 x (1*2*5 - 0.5*1) = 9.5."""
    block = np.concatenate([
        np.array([1.0, 0.5], dtype=np.float16).view(np.uint8),  # d, dmin
        np.array([2] * 4 + [1] * 4 + [0x12] * 4, dtype=np.uint8),  # scales 0-3, mins 0-3, (min << 4 | scale) 4-7
        np.full(128, 0x53, dtype=np.uint8),
    ])
    embedding = np.tile(block, (64, 1))  # (vocab 64, one 256-value block per row)
    path, _ = kquant_gguf(QType.Q4_K, override={"token_embd.weight": embedding})
    row = torch.tensor(([5.5] * 32 + [9.5] * 32) * 4)
    assert torch.equal(loaded(path)["model.embed_tokens.weight"], row.expand(64, 256))


# ---------------------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct Q4_1 file
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_smollm2_gguf_matches_transformers(smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers rebuilds gguf's (pure) tensor-name map once per submodule, ~2/3 of its load time here.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    checkpoint = open_checkpoint(smollm2_gguf, progress=False)
    config = checkpoint.config
    assert (config.n_layers, config.n_heads, config.n_kv_heads, config.dim, config.intermediate_size) == (
        30, 9, 3, 576, 1536)
    assert (config.rope_theta, config.tie_word_embeddings, config.vocab_size, config.head_dim) == (
        1e5, True, 49152, 64)
    theirs = LlamaForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).state_dict()
    count = 0
    for name, tensor in checkpoint.tensors():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, theirs[name]), name
        count += 1
    assert count == len(expected_tensor_shapes(config)) == 2 + 30 * 9


# ---------------------------------------------------------------------------------------------------------------
# Errors: one clear line naming the file and the problem
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [0.5, 0.01, 0.0], ids=["data", "metadata", "empty"])
def test_truncated_gguf(cut: float, tiny_gguf: TinyGGUF, assert_one_line_error: OneLineError) -> None:
    _, path = tiny_gguf("mha-untied", QType.F32)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * cut)])
    assert_one_line_error(lambda: open_checkpoint(path), str(path), "not a valid GGUF file")


def test_not_a_gguf_file(tmp_path: Path, assert_one_line_error: OneLineError) -> None:
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_one_line_error(lambda: open_checkpoint(path), str(path), "not a valid GGUF file")


def test_unsupported_gguf_architecture(tiny_gguf: TinyGGUF, assert_one_line_error: OneLineError) -> None:
    _, path = tiny_gguf("mha-untied", QType.F32, arch="gemma")
    assert_one_line_error(lambda: open_checkpoint(path), str(path), "unsupported GGUF architecture 'gemma'",
                          "'llama', 'qwen2'",
                          kind=UnsupportedCheckpointError)


def test_unsupported_gguf_tensor_type(tmp_path: Path, tiny_llama: TinyLlama, gguf_tensors: GGUFTensors,
                                      write_gguf: WriteGGUF, assert_one_line_error: OneLineError) -> None:
    model = tiny_llama("mha-untied")
    tensors = gguf_tensors(model, QType.Q8_0)
    block_size, type_size = gguf.GGML_QUANT_SIZES[QType.Q8_1]  # llama.cpp's activation type; no weight uses it
    tensors["blk.0.ffn_up.weight"] = (np.zeros((96, 64 // block_size * type_size), dtype=np.uint8), QType.Q8_1)
    path = write_gguf(tmp_path / "q8_1.gguf", model.config, tensors)
    assert_one_line_error(lambda: open_checkpoint(path), str(path), "tensor blk.0.ffn_up.weight has type Q8_1",
                          "supported: F32, F16, Q4_0", "IQ4_XS", kind=UnsupportedCheckpointError)


def test_missing_and_misshapen_gguf_tensors(tmp_path: Path, tiny_llama: TinyLlama, gguf_tensors: GGUFTensors,
                                            write_gguf: WriteGGUF,
                                            assert_one_line_error: OneLineError) -> None:
    model = tiny_llama("mha-untied")
    tensors = gguf_tensors(model, QType.F32)
    del tensors["blk.1.ffn_up.weight"]
    path = write_gguf(tmp_path / "missing.gguf", model.config, tensors)
    assert_one_line_error(lambda: open_checkpoint(path), str(path),
                          "missing tensor model.layers.1.mlp.up_proj.weight (blk.1.ffn_up.weight in the file)")

    path = write_gguf(tmp_path / "shape.gguf", model.config, gguf_tensors(model, QType.F32), feed_forward_length=128)
    assert_one_line_error(lambda: open_checkpoint(path), "has shape (96, 64), expected (128, 64)")


def test_gguf_without_required_metadata(tmp_path: Path, tiny_llama: TinyLlama, gguf_tensors: GGUFTensors,
                                        assert_one_line_error: OneLineError) -> None:
    model = tiny_llama("mha-untied")
    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    for name, (data, raw_type) in gguf_tensors(model, QType.F32).items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(lambda: open_checkpoint(tmp_path / "bare.gguf"), "GGUF metadata lacks llama.block_count")


# ---------------------------------------------------------------------------------------------------------------
# Hostile headers: values of the wrong type or range, and fewer layers than the file holds
# ---------------------------------------------------------------------------------------------------------------

def test_gguf_declaring_fewer_layers_than_it_holds(tiny_gguf: TinyGGUF, assert_one_line_error: OneLineError) -> None:
    """block_count 1 of 2 used to load layer 0 only and generate nonsense with exit status 0."""
    _, path = tiny_gguf("mha-untied", QType.F32, block_count=1)
    assert_one_line_error(lambda: open_checkpoint(path, progress=False), str(path), "(blk.1.",
                          "is not part of the model the config describes (1 layers; 9 such tensors)")


@pytest.mark.parametrize("key, value, fragment", [
    ("block_count", "5", "llama.block_count = '5' is not an integer"),
    ("context_length", 2 ** 32 - 1, "llama.context_length = 4294967295 is outside [1, 2097152]"),
    ("context_length", -5, "llama.context_length = -5 is outside"),
    ("head_count", 0, "llama.attention.head_count = 0 is outside"),
    ("embedding_length", 64.0, "llama.embedding_length = 64.0 is not an integer"),
    ("layer_norm_rms_eps", float("nan"), "llama.attention.layer_norm_rms_epsilon = nan is not a positive finite"),
], ids=["block-count-string", "context-2^32", "context-negative", "heads-0", "dim-float", "eps-nan"])
def test_gguf_metadata_of_the_wrong_type_or_range(key: str, value: Any, fragment: str, tmp_path: Path,
                                                  tiny_llama: TinyLlama, gguf_tensors: GGUFTensors,
                                                  assert_one_line_error: OneLineError) -> None:
    """One line naming the file and the key; a 2^32-1 context used to allocate rotary tables of that length."""
    model = tiny_llama("mha-untied")
    writer = gguf.GGUFWriter(tmp_path / "bad.gguf", "llama")
    config = model.config
    meta = dict(block_count=config.num_hidden_layers, context_length=config.max_position_embeddings,
                embedding_length=config.hidden_size, feed_forward_length=config.intermediate_size,
                head_count=config.num_attention_heads, layer_norm_rms_eps=1e-5, vocab_size=config.vocab_size)
    typed = {str: writer.add_string, float: writer.add_float32, int: writer.add_int64}
    for name, raw in {**meta, key: value}.items():
        full = {"head_count": "attention.head_count",
                "layer_norm_rms_eps": "attention.layer_norm_rms_epsilon"}.get(name, name)
        typed[type(raw)](f"llama.{full}", raw)
    for name, (data, raw_type) in gguf_tensors(model, QType.F32).items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(lambda: open_checkpoint(tmp_path / "bad.gguf", progress=False), str(tmp_path / "bad.gguf"),
                          fragment, kind=UnsupportedCheckpointError)


def test_gguf_unknown_tensor_is_refused(tmp_path: Path, tiny_llama: TinyLlama, gguf_tensors: GGUFTensors,
                                        write_gguf: WriteGGUF, assert_one_line_error: OneLineError) -> None:
    model = tiny_llama("mha-untied")
    tensors = gguf_tensors(model, QType.F32)
    tensors["blk.0.attn_qkv.weight"] = (np.zeros((192, 64), dtype=np.float32), None)  # a fused QKV we do not read
    path = write_gguf(tmp_path / "extra.gguf", model.config, tensors)
    assert_one_line_error(lambda: open_checkpoint(path, progress=False), "tensor blk.0.attn_qkv.weight is not part")
