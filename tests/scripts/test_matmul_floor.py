"""scripts/bench/matmul_floor.py: the weight matmuls of one token."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minilade import LLM
from scripts.bench import matmul_floor


def test_matmul_floor_counts_every_weight_matrix_once(tiny_checkpoint: Path, capsys) -> None:
    assert matmul_floor.main(["--ckpt", str(tiny_checkpoint), "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "| float32 |" in out and "| bfloat16 |" in out and out.startswith("machine: ")
    llm = LLM.load(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False, exact=False)
    matrices = [w for w in llm.model.parameters() if w.dim() == 2]
    assert f"{len(matrices)} weight matrices, {sum(w.numel() for w in matrices) / 1e6:.1f} M parameters" in out
    config = json.loads((tiny_checkpoint / "config.json").read_text())  # untied: embedding and head both count
    dim, hidden, kv_dim = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"] * (
        config["hidden_size"] // config["num_attention_heads"])
    per_layer = 2 * dim * dim + 2 * kv_dim * dim + 3 * dim * hidden
    assert not config["tie_word_embeddings"]
    assert sum(w.numel() for w in matrices) == config["num_hidden_layers"] * per_layer + 2 * config["vocab_size"] * dim


def test_floor_row_arithmetic() -> None:
    weights = [torch.zeros(1000, 500), torch.zeros(250, 1000)]  # 750 000 floats: 3 MB
    assert matmul_floor.floor_row("float32", weights, 0.002) == "| float32 | 3 | 2.0 | 500.0 | 1.5 |"
    half = [w.to(torch.bfloat16) for w in weights]
    assert matmul_floor.floor_row("bfloat16", half, 0.002) == "| bfloat16 | 2 | 2.0 | 500.0 | 0.8 |"
