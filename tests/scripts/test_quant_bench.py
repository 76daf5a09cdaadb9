"""scripts/bench/quant.py: the quantized contenders run on the path LLM.load gives them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench import quant

from ..helpers import write_tiny_checkpoint

# One worker under pytest-xdist compiles these graphs, once (compiled graphs live in the process that made them).
pytestmark = pytest.mark.xdist_group("compiled")


@pytest.fixture(scope="module")
def quantizable_checkpoint(tmp_path_factory) -> Path:
    """A tiny checkpoint whose every layer int4 can pack (a vocabulary of a multiple of 16 tokens)."""
    pytest.importorskip("transformers")
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "a b c d hello world", max_positions=512)


def test_decode_and_steps_run_every_contender_batch_invariant(quantizable_checkpoint: Path, data_dir: Path,
                                                              tmp_path: Path) -> None:
    argv = ["--parts", "decode", "steps", "--ckpt", str(quantizable_checkpoint), "--data-dir", str(data_dir),
            "--n-prompts", "1", "--max-new-tokens", "6", "--repeats", "1", "--out-dir", str(tmp_path),
            "--compiled", "int4"]
    assert quant.main(argv) == 0
    results = json.loads((tmp_path / "quant_results.json").read_text())
    decode = results["decode"]
    timed = {"float32", "bfloat16", "int8", "int8 bf16 model", "int4", "int4 bf16 model", "w7a8"}
    assert set(decode["table"]) == timed | {"int4 compiled"} and decode["table"]["float32"]["vs_float32"] == 1.0
    assert decode["table"]["int4 compiled"]["tokens_per_s"] > 0
    assert {name: same for name, same in decode["exact"].items() if name in timed} == dict.fromkeys(timed, "1/1")
    assert decode["compiled_exact"] == {"int4 compiled": "1/1"}  # exact through compiled steps too
    assert set(results["steps"]) >= {"table"}


def test_random_int4_model_holds_no_float_matrix_and_decodes() -> None:
    """The 7b part's builder, on a tiny config: every matrix quantized (only norm vectors are float), and the model
    decodes."""
    import torch

    from minilade.config import ModelConfig
    from minilade.decoding import Autoregressive

    model = quant.random_int4_model(ModelConfig.preset("tiny-mha"), 32, seed=0)
    assert all(p.dim() == 1 for p in model.parameters())
    assert isinstance(model.tok_embeddings, quant.QuantizedEmbedding)
    with torch.inference_mode():
        tokens, stats = quant.generate(model, [1, 2, 3], Autoregressive(), 4)
    assert len(tokens) == 4 and stats.new_tokens == 4


def test_ppl_compares_every_contender_with_float32(quantizable_checkpoint: Path, data_dir: Path,
                                                   tmp_path: Path) -> None:
    argv = ["--parts", "ppl", "--ckpt", str(quantizable_checkpoint), "--data-dir", str(data_dir),
            "--ppl-prompts", "1", "--out-dir", str(tmp_path)]
    assert quant.main(argv) == 0
    table = json.loads((tmp_path / "quant_results.json").read_text())["ppl"]["table"]
    assert {"float32", "int8", "int4", "w7a8", "int4 rtn g32"} <= set(table)  # dim 32: no group of 64
    assert table["float32"]["vs_float32"] == 0.0 and all(row["ppl"] > 1 for row in table.values())
