"""Tensor names: Hugging Face LlamaForCausalLM's (the canonical names every loader yields) -> this model's."""

from __future__ import annotations

from typing import Iterable

import torch

from ..config import ModelConfig


def hf_to_minilade_state_dict(tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, *,
                              dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Rename Hugging Face LLaMA tensors to this model's names, fusing q/k/v and gate/up as they arrive."""
    direct = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attention_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attention.wo.weight",
        "self_attn.o_proj.bias": "attention.wo.bias",
        "mlp.down_proj.weight": "feed_forward.w_down.weight",
        "mlp.down_proj.bias": "feed_forward.w_down.bias",
    }
    fused = {  # our name -> the HF parts, concatenated in this order along the output dimension
        "attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "feed_forward.w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    }
    part_of = {f"{part}.{kind}": (ours, kind) for ours, parts in fused.items() for part in parts
               for kind in ("weight", "bias")}
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        tensor = tensor.to(device=device, dtype=dtype)
        if name in direct:
            state[direct[name]] = tensor
            continue
        if not name.startswith("model.layers."):
            continue  # e.g. rotary inv_freq buffers
        layer, rest = name[len("model.layers."):].split(".", 1)
        prefix = f"layers.{layer}."
        if rest in per_layer:
            state[prefix + per_layer[rest]] = tensor
        elif rest in part_of:
            ours, kind = part_of[rest]
            key = f"{prefix}{ours}.{kind}"
            pending.setdefault(key, {})[rest] = tensor
            parts = [f"{p}.{kind}" for p in fused[ours]]
            if all(p in pending[key] for p in parts):
                done = pending.pop(key)
                state[key] = torch.cat([done[p] for p in parts], dim=0)
    if pending:
        raise ValueError(f"incomplete fused weights: {sorted(pending)[:3]}")
    return state
