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


def test_non_finite_weights_are_refused(tmp_path: Path, tiny_llama: TinyLlama,
                                        assert_one_line_error: Callable[..., str]) -> None:
    """A corrupted tensor (found by the fuzzer: a flipped scale turns Q8_0 blocks into NaN) must not run."""
    from safetensors.torch import save_file

    model = tiny_llama("mha-untied")
    model.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(state, tmp_path / "model.safetensors")
    assert_one_line_error(lambda: open_checkpoint(tmp_path).load_model(dtype=torch.float32, device="cpu"),
                          str(tmp_path), "tensor model.layers.1.mlp.up_proj.weight holds NaN or infinite values")


def test_build_model_errors_name_the_file_through_load_model(tmp_path: Path, tiny_llama: TinyLlama,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             assert_one_line_error: Callable[..., str]) -> None:
    from minilade.checkpoints import checkpoint as module

    tiny_llama("mha-untied").save_pretrained(tmp_path)
    checkpoint = open_checkpoint(tmp_path, progress=False)
    original = checkpoint.tensors
    monkeypatch.setattr(module.Checkpoint, "tensors",
                        lambda self, given=(): ((n, t) for n, t in original() if n != "model.norm.weight"))
    assert_one_line_error(lambda: checkpoint.load_model(dtype=torch.float32, device="cpu"),
                          f"{tmp_path}: weights do not fit the model: missing ['norm.weight']")


@pytest.mark.parametrize("value, refused", [(60000.0, False), (float("inf"), True), (float("-inf"), True)])
def test_finite_check_is_exact_where_a_sum_overflows(tmp_path: Path, tiny_llama: TinyLlama, value: float,
                                                     refused: bool) -> None:
    """float16 weights near the format's largest value sum to infinity yet are finite: they load; an infinity is
    refused. (The check sums a tensor first and looks at each value only when the sum is not finite.)"""
    from safetensors.torch import save_file

    model = tiny_llama("mha-untied")
    model.save_pretrained(tmp_path)
    state = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
    state["model.layers.0.mlp.up_proj.weight"][:2] = value
    save_file(state, tmp_path / "model.safetensors")
    checkpoint = open_checkpoint(tmp_path, progress=False)
    if refused:
        with pytest.raises(CheckpointError, match="holds NaN or infinite values"):
            checkpoint.load_model(dtype=torch.float32, device="cpu")
    else:
        loaded = checkpoint.load_model(dtype=torch.float16, device="cpu")
        assert torch.equal(loaded.layers[0].feed_forward.w_gate_up.weight[96:98], torch.full((2, 64), value).half())


def test_building_a_model_initialises_nothing(tmp_path: Path, tiny_llama: TinyLlama) -> None:
    """Loading builds the modules on the meta device and skips their initialisers: on meta they fill nothing, but
    the embedding's would import torch._dynamo, seconds of every start."""
    import subprocess
    import sys

    tiny_llama("gqa-tied").save_pretrained(tmp_path)
    code = ("import sys, torch; from minilade.checkpoints import open_checkpoint; "
            f"open_checkpoint({str(tmp_path)!r}, progress=False).load_model(dtype=torch.float32, device='cpu'); "
            "print('torch._dynamo' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"
