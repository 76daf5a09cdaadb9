"""Fixtures shared by the checkpoint tests: tiny random `transformers.LlamaForCausalLM` models as the reference,
GGUF files written with gguf.GGUFWriter the way llama.cpp's converter writes them (its tensor names from gguf's
own name map, its Q/K row permutation, 1-D tensors kept F32), and a check for one-line errors.

Builders are fixtures that return the builder function (pytest's "factory as fixture"), so that test files
share them without importing each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import LlamaConfig, LlamaForCausalLM

from minilade.checkpoints import CheckpointError, download, open_checkpoint

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
GGUFTensorData = dict[str, tuple[np.ndarray, QType | None]]  # GGUF name -> (stored data, raw type)


def _tiny_llama(name: str, seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    config = LlamaConfig(**{**TINY_BASE, **TINY[name], **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model


def _canonical_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def _loaded(ckpt: str | Path) -> dict[str, torch.Tensor]:
    tensors = dict(open_checkpoint(ckpt, progress=False).tensors())
    assert all(t.device.type == "cpu" for t in tensors.values())
    return tensors


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> llama.cpp's interleaved rotary pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _encode(array: np.ndarray, qtype: QType) -> tuple[np.ndarray, QType | None]:
    """Stored data and raw type for one tensor; 1-D tensors stay F32 as in llama.cpp's converter."""
    if array.ndim == 1 or qtype == QType.F32:
        return array.astype(np.float32), None
    if qtype == QType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def _gguf_tensors(model: LlamaForCausalLM, qtype: QType, arch: str = "llama") -> GGUFTensorData:
    """As llama.cpp's converter stores them: Q/K rows permuted in 'llama' files (LlamaModel.modify_tensors), kept
    in 'qwen2' files (Qwen2Model does not permute)."""
    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    stored = {}
    for name, tensor in _canonical_state(model).items():
        stem, suffix = name.rsplit(".", 1)
        data = tensor.float().numpy()
        if ".q_proj." in name and arch == "llama":
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif ".k_proj." in name and arch == "llama":
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        stored[f"{name_map.get_name(stem)}.{suffix}"] = _encode(data, qtype)
    return stored


def _write_gguf(path: Path, config: LlamaConfig, tensors: GGUFTensorData, arch: str = "llama",
                **meta_overrides: int) -> Path:
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


def _assert_one_line_error(action: Callable[[], object], *fragments: str,
                           kind: type[Exception] = CheckpointError) -> str:
    with pytest.raises(kind) as info:
        action()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def _no_pip(*args: object, **kwargs: object) -> None:
    raise AssertionError("pip must not run when the file is already present")


@pytest.fixture(params=list(TINY))
def tiny_name(request: pytest.FixtureRequest) -> str:
    """Each TINY configuration by name, in turn."""
    return request.param


@pytest.fixture(scope="session")
def tiny_llama() -> Callable[..., LlamaForCausalLM]:
    """(name in TINY, seed=0, **LlamaConfig overrides) -> a random tiny LLaMA; norms and biases random too, so a
    swapped or mis-mapped tensor cannot go unseen."""
    return _tiny_llama


@pytest.fixture(scope="session")
def canonical_state() -> Callable[[LlamaForCausalLM], dict[str, torch.Tensor]]:
    """model -> transformers' state dict minus the tied head (the canonical dict has no lm_head.weight when tied)."""
    return _canonical_state


@pytest.fixture(scope="session")
def loaded() -> Callable[[str | Path], dict[str, torch.Tensor]]:
    """checkpoint -> every tensor open_checkpoint yields for it, checked to be on the CPU."""
    return _loaded


@pytest.fixture(scope="session")
def gguf_tensors() -> Callable[[LlamaForCausalLM, QType], GGUFTensorData]:
    """(model, qtype, arch="llama") -> GGUF name -> (stored data, raw type), converted like llama.cpp does (names
    from gguf's own map)."""
    return _gguf_tensors


@pytest.fixture(scope="session")
def write_gguf() -> Callable[..., Path]:
    """(path, LlamaConfig, tensors, arch="llama", **metadata overrides, e.g. feed_forward_length or
    sliding_window) -> path of a GGUF file with llama.cpp's metadata keys for the config."""
    return _write_gguf


@pytest.fixture(scope="session")
def assert_one_line_error() -> Callable[..., str]:
    """(action, *fragments, kind=CheckpointError) -> the message: `action` raises `kind` with a single-line
    message containing every fragment."""
    return _assert_one_line_error


@pytest.fixture
def forbid_pip(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to make any later `pip download` fail the test (a present file must be reused)."""
    return lambda: monkeypatch.setattr(download, "_pip_download", _no_pip)
