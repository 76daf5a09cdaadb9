"""The names table (minilade.checkpoints.names) against independent references: transformers' LlamaForCausalLM
state dict, gguf's own tensor-name map (what llama.cpp's converter writes), and minilade's Transformer."""

from __future__ import annotations

import random
from typing import Callable

import gguf
import pytest
import torch
from transformers import LlamaForCausalLM

from minilade.checkpoints import CheckpointError, expected_tensor_shapes
from minilade.checkpoints.hf import config_from_hf
from minilade.checkpoints.names import (
    canonical_name,
    checkpoint_tensors,
    gguf_name,
    layout_flags,
    model_state_dict,
)
from minilade.config import ModelConfig
from minilade.model import Transformer

StateOf = Callable[[LlamaForCausalLM], dict[str, torch.Tensor]]
# attention_bias (q, k, v and o) and mlp_bias are independent flags; each alone, and both with an untied head.
BIAS_VARIANTS = {
    "attention-bias": dict(attention_bias=True),
    "mlp-bias": dict(mlp_bias=True),
    "both-untied": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
}


def test_expected_tensor_shapes_match_transformers(tiny_name: str, tiny_llama: Callable[..., LlamaForCausalLM],
                                                   canonical_state: StateOf) -> None:
    model = tiny_llama(tiny_name)
    expected = expected_tensor_shapes(config_from_hf(model.config.to_dict()))
    assert expected == {k: tuple(v.shape) for k, v in canonical_state(model).items()}


@pytest.mark.parametrize("variant", BIAS_VARIANTS)
def test_bias_flags_match_transformers(variant: str, tiny_llama: Callable[..., LlamaForCausalLM],
                                       canonical_state: StateOf) -> None:
    """Each bias flag adds exactly the biases transformers has; layout_flags reads the flags back from the names."""
    model = tiny_llama("gqa-tied", **BIAS_VARIANTS[variant])
    config = config_from_hf(model.config.to_dict())
    state = canonical_state(model)
    assert expected_tensor_shapes(config) == {k: tuple(v.shape) for k, v in state.items()}
    flags = layout_flags(state.keys())
    assert flags == {"tie_word_embeddings": config.tie_word_embeddings, "qkv_bias": config.qkv_bias,
                     "o_bias": config.o_bias, "mlp_bias": config.mlp_bias}


def bias_config() -> ModelConfig:
    return ModelConfig.preset("tiny-gqa").replace(qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=False)


def test_gguf_names_round_trip_and_match_gguf_name_map() -> None:
    """Every canonical name of a config with biases and a head has a GGUF name, the one gguf's own map (used by
    llama.cpp's converter) gives, and canonical_name inverts it."""
    config = bias_config()
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.n_layers)
    names = list(checkpoint_tensors(config))
    assert len(names) == 3 + config.n_layers * (9 + 7)  # 2 norms + 7 linears with weight and bias per layer
    layers = [int(name.split(".")[2]) for name in names[1:-2]]  # forward order: a layer's tensors together
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert layers == sorted(layers)
    for name in names:
        stem, suffix = name.rsplit(".", 1)
        stored = gguf_name(name)
        assert stored == f"{name_map.get_name(stem)}.{suffix}", name
        assert canonical_name(stored) == name, stored


@pytest.mark.parametrize("name", ["rope_freqs.weight", "blk.0.attn_rot_embd", "blk.0.unknown.weight",
                                  "token_embd.scale"])
def test_gguf_tensors_outside_the_table_have_no_canonical_name(name: str) -> None:
    assert canonical_name(name) is None


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.rotary_emb.inv_freq", "lm_head.scale", "other"])
def test_canonical_names_outside_the_table_keep_their_name(name: str) -> None:
    assert gguf_name(name) == name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_our_names_and_fused_shapes_equal_the_model(tied: bool) -> None:
    """Grouped by our parameter, the table's parts add up (along dim 0) to model.py's parameter shapes."""
    config = bias_config().replace(tie_word_embeddings=tied)
    fused: dict[str, list[int]] = {}
    for spec in checkpoint_tensors(config).values():
        rows = fused.setdefault(spec.ours, [0, *spec.shape[1:]])
        rows[0] += spec.shape[0]
    with torch.device("meta"):
        model = Transformer(config)
    params = {name: list(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    if tied:
        del params["output.weight"]  # the embedding, shared
    assert fused == params


def test_model_state_dict_fuses_in_slot_order(tiny_llama: Callable[..., LlamaForCausalLM],
                                              canonical_state: StateOf) -> None:
    """q, k, v and gate, up are concatenated in that order whatever order they arrive in; extra tensors
    (rotary inv_freq) are skipped; dtype is converted."""
    model = tiny_llama("gqa-bias")
    config = config_from_hf(model.config.to_dict())
    state = canonical_state(model)
    arriving = [*state.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4))]
    random.Random(0).shuffle(arriving)
    ours = model_state_dict(arriving, config, dtype=torch.float64, device="cpu")
    assert len(ours) == len(state) - 6 * config.n_layers  # per layer: q, k, v -> wqkv, gate, up -> w_gate_up, x2 bias
    for i in range(config.n_layers):
        hf, mine = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = torch.cat([state[f"{hf}self_attn.{p}_proj.{kind}"] for p in "qkv"])
            gate_up = torch.cat([state[f"{hf}mlp.{p}_proj.{kind}"] for p in ("gate", "up")])
            assert torch.equal(ours[f"{mine}attention.wqkv.{kind}"], qkv.double())
            assert torch.equal(ours[f"{mine}feed_forward.w_gate_up.{kind}"], gate_up.double())
        assert torch.equal(ours[f"{mine}attention.wo.bias"], state[f"{hf}self_attn.o_proj.bias"].double())
    assert torch.equal(ours["output.weight"], state["lm_head.weight"].double())
    assert all(t.dtype == torch.float64 for t in ours.values())


def test_model_state_dict_missing_part(tiny_llama: Callable[..., LlamaForCausalLM],
                                       canonical_state: StateOf) -> None:
    model = tiny_llama("mha-untied")
    state = canonical_state(model)
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(CheckpointError, match=r"incomplete fused weights: \['layers.1.attention.wqkv.weight'\]"):
        model_state_dict(state.items(), config_from_hf(model.config.to_dict()), dtype=torch.float32, device="cpu")
