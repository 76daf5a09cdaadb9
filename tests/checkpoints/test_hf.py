"""Hugging Face safetensors folders and config.json (minilade.checkpoints.hf), against transformers'
save_pretrained output."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from minilade.checkpoints import (
    CheckpointError,
    UnsupportedCheckpointError,
    open_checkpoint,
)
from minilade.checkpoints.hf import config_from_hf, read_hf_config
from minilade.config import RopeScaling
from minilade.errors import UnsupportedModelError

TinyLlama = Callable[..., LlamaForCausalLM]
StateOf = Callable[[LlamaForCausalLM], dict[str, torch.Tensor]]


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_safetensors_equal_transformers_state_dict(tmp_path: Path, tiny_name: str, sharded: bool,
                                                   tiny_llama: TinyLlama, canonical_state: StateOf) -> None:
    model = tiny_llama(tiny_name)
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
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (hf.attention_bias, hf.attention_bias, hf.mlp_bias)
    assert (config.rope_theta, config.norm_eps) == (10000.0, 1e-5)


def test_safetensors_keep_stored_dtype_and_ignore_extra_tensors(
        tmp_path: Path, tiny_llama: TinyLlama, canonical_state: StateOf,
        loaded: Callable[[Path], dict[str, torch.Tensor]]) -> None:
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
# config.json
# ---------------------------------------------------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
MINIMAL = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64)


@pytest.mark.parametrize("rope", [
    {"rope_theta": 5e5, "rope_scaling": LLAMA3_ROPE},  # transformers 4.x
    {"rope_parameters": {"rope_theta": 5e5, **LLAMA3_ROPE}},  # transformers 5
], ids=["rope_scaling", "rope_parameters"])
def test_config_reads_both_rope_forms(rope: dict[str, Any]) -> None:
    config = config_from_hf({**MINIMAL, **rope})
    assert config.rope_theta == 5e5
    assert config.rope_scaling == RopeScaling(kind="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=64)


def test_config_defaults_and_token_ids() -> None:
    config = config_from_hf({**MINIMAL, "eos_token_id": [2, 7], "bos_token_id": 1})
    assert (config.n_kv_heads, config.head_dim, config.norm_eps, config.max_seq_len) == (4, 8, 1e-6, 2048)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2, 7))
    assert config_from_hf({**MINIMAL, "eos_token_id": 2}).eos_token_ids == (2,)
    assert not (config.tie_word_embeddings or config.qkv_bias or config.o_bias or config.mlp_bias)


@pytest.mark.parametrize("change, fragment", [
    ({"model_type": "gpt2"}, "unsupported architecture 'gpt2'"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
      "num_hidden_layers": 2}, "a sliding window on some layers only"),
    ({"hidden_act": "gelu"}, "unsupported activation 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling type 'yarn'"),
    ({"num_key_value_heads": 3}, "n_heads=4 is not a multiple of n_kv_heads=3"),
], ids=["architecture", "sliding-window", "activation", "rope", "heads"])
def test_config_rejects_models_that_are_not_llama_like(change: dict[str, Any], fragment: str) -> None:
    with pytest.raises(UnsupportedModelError, match=re.escape(fragment)):
        config_from_hf({**MINIMAL, **change})


@pytest.mark.parametrize("change, window", [
    ({"model_type": "mistral", "sliding_window": 128, "max_position_embeddings": 128}, 0),  # hides nothing
    ({"model_type": "mistral", "sliding_window": 64, "max_position_embeddings": 128}, 64),
    ({"model_type": "mistral", "sliding_window": None}, 0),
    ({"model_type": "llama", "sliding_window": 64}, 0),  # not a LLaMA option: transformers ignores it too
    ({"model_type": "qwen2", "sliding_window": 64}, 0),  # without use_sliding_window
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, 64),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, 0),
], ids=["mistral-context", "mistral", "mistral-null", "llama", "qwen2-off", "qwen2-all-layers", "qwen2-no-layer"])
def test_config_sliding_window(change: dict[str, Any], window: int) -> None:
    assert config_from_hf({**MINIMAL, "max_position_embeddings": 128, **change}).sliding_window == window


def test_config_qwen2_biases_on_q_k_v_only() -> None:
    config = config_from_hf({**MINIMAL, "model_type": "qwen2", "attention_bias": False, "mlp_bias": True})
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True, False, False)


# ---------------------------------------------------------------------------------------------------------------
# Errors: one clear line naming the file and the problem
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path: Path, tiny_llama: TinyLlama) -> Path:
    tiny_llama("mha-untied").save_pretrained(tmp_path)
    return tmp_path


def test_truncated_safetensors(hf_dir: Path, assert_one_line_error: Callable[..., str]) -> None:
    file = hf_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])
    assert_one_line_error(lambda: open_checkpoint(hf_dir), str(file), "not a valid safetensors file",
                          "truncated or corrupt")


def test_corrupt_safetensors_header(hf_dir: Path, assert_one_line_error: Callable[..., str]) -> None:
    file = hf_dir / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:16] = b"#garbage"  # the JSON header starts at byte 8
    file.write_bytes(bytes(data))
    assert_one_line_error(lambda: open_checkpoint(hf_dir), str(file), "truncated or corrupt")


def test_missing_shard(tmp_path: Path, tiny_llama: TinyLlama, assert_one_line_error: Callable[..., str]) -> None:
    tiny_llama("mha-untied").save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(lambda: open_checkpoint(tmp_path), f"lists {shard.name}, which is missing")


def test_unsupported_hf_architecture(hf_dir: Path, assert_one_line_error: Callable[..., str]) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    message = assert_one_line_error(lambda: open_checkpoint(hf_dir), str(hf_dir / "config.json"), "'gpt2'",
                                    kind=UnsupportedCheckpointError)
    assert "unsupported architecture" in message
    with pytest.raises(UnsupportedModelError):  # also catchable as the config module's error
        read_hf_config(hf_dir / "config.json")


@pytest.mark.parametrize("change, fragment, kind", [
    ({"hidden_size": None}, "missing required key 'hidden_size'", CheckpointError),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantised Hugging Face checkpoints (gptq) are not supported",
     UnsupportedCheckpointError),
], ids=["missing-key", "quantised"])
def test_config_json_errors_name_the_file(hf_dir: Path, change: dict[str, Any], fragment: str,
                                          kind: type[Exception], assert_one_line_error: Callable[..., str]) -> None:
    path = hf_dir / "config.json"
    config = {**json.loads(path.read_text()), **change}
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    assert_one_line_error(lambda: open_checkpoint(hf_dir), f"{path}: {fragment}", kind=kind)


def test_missing_and_misshapen_safetensors_tensors(hf_dir: Path, tiny_llama: TinyLlama, canonical_state: StateOf,
                                                   assert_one_line_error: Callable[..., str]) -> None:
    state = canonical_state(tiny_llama("mha-untied"))
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, hf_dir / "model.safetensors")
    assert_one_line_error(lambda: open_checkpoint(hf_dir), str(hf_dir), f"missing tensor {name}")

    save_file({**state, name: torch.zeros(95, 64)}, hf_dir / "model.safetensors")
    assert_one_line_error(lambda: open_checkpoint(hf_dir), f"tensor {name} has shape (95, 64), expected (96, 64)")


# ---------------------------------------------------------------------------------------------------------------
# Hostile folders: wrong types and ranges, layers the config does not count, integer weights, shard
# names outside the folder
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, fragment", [
    ({"num_attention_heads": 0}, "num_attention_heads = 0 is outside"),
    ({"num_hidden_layers": -1}, "num_hidden_layers = -1 is outside"),
    ({"max_position_embeddings": -5}, "max_position_embeddings = -5 is outside"),
    ({"max_position_embeddings": 2 ** 40}, "max_position_embeddings = 1099511627776 is outside [1, 2097152]"),
    ({"vocab_size": 272.0}, "vocab_size = 272.0 is not an integer"),
    ({"hidden_size": "64"}, "hidden_size = '64' is not an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers = True is not an integer"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps = '1e-5' is not a positive finite number"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings = 'false' is not true or false"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id = (2, 'x') is not a list"),
    ({"rope_scaling": "linear"}, "rope_scaling = 'linear' is not an object"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "rope scaling factor = '2' is not a positive"),
    ({"model_type": "mistral", "sliding_window": "4096"}, "sliding_window = '4096' is not an integer"),
], ids=["heads-0", "layers-negative", "context-negative", "context-2^40", "vocab-float", "dim-string", "bool",
        "eps-string", "flag-string", "eos", "rope-string", "rope-factor", "sliding-window-string"])
def test_config_values_of_the_wrong_type_or_range(hf_dir: Path, change: dict[str, Any], fragment: str,
                                                  assert_one_line_error: Callable[..., str]) -> None:
    """One line naming the file and the key, never a traceback; no table sized by a 2^40 context is built."""
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    assert_one_line_error(lambda: open_checkpoint(hf_dir, progress=False), f"{path}: {fragment}",
                          kind=UnsupportedCheckpointError)


def test_quantization_config_that_is_not_an_object(hf_dir: Path, assert_one_line_error: Callable[..., str]) -> None:
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": "int8"}))
    assert_one_line_error(lambda: open_checkpoint(hf_dir), f"{path}: quantization_config = 'int8' is not an object")


def test_config_with_fewer_layers_than_the_weights(hf_dir: Path, assert_one_line_error: Callable[..., str]) -> None:
    """num_hidden_layers 1 of 2 used to load layer 0 only and generate nonsense with exit status 0."""
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_hidden_layers": 1}))
    assert_one_line_error(lambda: open_checkpoint(hf_dir), str(hf_dir), "tensor model.layers.1.",
                          "is not part of the model the config describes (1 layers; 9 such tensors)")


def test_biases_the_config_does_not_enable(hf_dir: Path, tiny_llama: TinyLlama, canonical_state: StateOf,
                                           assert_one_line_error: Callable[..., str]) -> None:
    state = canonical_state(tiny_llama("mha-untied"))
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, hf_dir / "model.safetensors")
    assert_one_line_error(lambda: open_checkpoint(hf_dir), "tensor model.layers.0.self_attn.q_proj.bias is not part")


def test_stored_head_of_a_tied_model_is_accepted(tmp_path: Path, tiny_llama: TinyLlama,
                                                 canonical_state: StateOf) -> None:
    """Some hub checkpoints store lm_head.weight although tied; transformers ties it anyway, and so do we."""
    model = tiny_llama("gqa-tied")
    model.save_pretrained(tmp_path)
    state = canonical_state(model)
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, tmp_path / "model.safetensors")
    assert dict(open_checkpoint(tmp_path).tensors()).keys() == state.keys()


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.uint8, torch.bool], ids=str)
def test_integer_weights_are_refused(hf_dir: Path, tiny_llama: TinyLlama, canonical_state: StateOf,
                                     dtype: torch.dtype, assert_one_line_error: Callable[..., str]) -> None:
    """They used to be cast to the run's float dtype silently, i.e. garbage weights."""
    state = canonical_state(tiny_llama("mha-untied"))
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({**state, name: state[name].to(dtype)}, hf_dir / "model.safetensors")
    assert_one_line_error(lambda: open_checkpoint(hf_dir), str(hf_dir / "model.safetensors"),
                          f"tensor {name} has dtype", "minilade loads floating-point weights",
                          kind=UnsupportedCheckpointError)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../x.safetensors",
                                   "config.json"], ids=["parent", "absolute", "nested-parent", "not-safetensors"])
def test_shard_index_pointing_outside_the_folder(tmp_path: Path, tiny_llama: TinyLlama, shard: str,
                                                 assert_one_line_error: Callable[..., str]) -> None:
    folder = tmp_path / "ckpt"
    tiny_llama("mha-untied").save_pretrained(folder, max_shard_size="40KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    (tmp_path / "outside.safetensors").write_bytes((folder / index["weight_map"][first]).read_bytes())
    index["weight_map"][first] = shard
    index_path.write_text(json.dumps(index))
    assert_one_line_error(lambda: open_checkpoint(folder), str(index_path), f"lists {shard!r}",
                          "which is not a .safetensors file inside")


def test_tensor_stored_in_two_shards(tmp_path: Path, tiny_llama: TinyLlama,
                                     assert_one_line_error: Callable[..., str]) -> None:
    tiny_llama("mha-untied").save_pretrained(tmp_path, max_shard_size="40KB")
    first, last = sorted(tmp_path.glob("model-*.safetensors"))[::len(list(tmp_path.glob("model-*.safetensors"))) - 1]
    with safe_open(first, framework="pt") as head, safe_open(last, framework="pt") as tail:
        name = next(iter(tail.keys()))
        tensors = {key: head.get_tensor(key) for key in head.keys()} | {name: tail.get_tensor(name)}
    save_file(tensors, first)
    assert_one_line_error(lambda: open_checkpoint(tmp_path), str(tmp_path), f"tensor {name} is also stored in")
