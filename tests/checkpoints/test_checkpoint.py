"""The format-independent view (minilade.checkpoints.checkpoint): a Checkpoint's model, built from its tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import LlamaForCausalLM

from minilade.checkpoints import CheckpointError, build_model, open_checkpoint

TinyLlama = Callable[..., LlamaForCausalLM]


def test_load_model_is_build_model_with_the_checkpoint_weights(tmp_path: Path, tiny_llama: TinyLlama) -> None:
    hf = tiny_llama("gqa-tied")
    hf.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(tmp_path, progress=False)
    model = checkpoint.load_model(dtype=torch.float64, device="cpu")
    built = build_model(checkpoint.config, checkpoint.tensors(), dtype=torch.float64, device="cpu")
    assert model.state_dict().keys() == built.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float64 and torch.equal(tensor, built.state_dict()[name]), name

    attention = hf.model.layers[1].self_attn
    qkv = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).double()
    assert torch.equal(model.layers[1].attention.wqkv.weight, qkv)
    assert model.output.weight is model.tok_embeddings.weight  # tied: one matrix, not a copy
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_build_model_names_missing_weights(tmp_path: Path, tiny_llama: TinyLlama) -> None:
    tiny_llama("mha-untied").save_pretrained(tmp_path)
    checkpoint = open_checkpoint(tmp_path, progress=False)
    tensors = ((name, t) for name, t in checkpoint.tensors() if name != "model.norm.weight")
    with pytest.raises(CheckpointError, match=r"weights do not fit the model: missing \['norm.weight'\]"):
        build_model(checkpoint.config, tensors, dtype=torch.float32, device="cpu")
