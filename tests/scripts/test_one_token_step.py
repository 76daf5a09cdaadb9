"""scripts/bench/one_token_step.py: the one-token step timed alone, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minilade.config import ModelConfig
from minilade.integer_linear import W7A8Linear
from minilade.model import Transformer
from minilade.quant import quantize_embedding, quantize_linears
from scripts.bench import compile_regions, one_token_step

from ..helpers import tiny_model


def test_prints_one_json_line_with_the_median_step(tiny_checkpoint: Path, capsys) -> None:
    assert one_token_step.main(["--ckpt", str(tiny_checkpoint), "--context", "5", "--steps", "3",
                                "--bandwidth-mib", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ms"] > 0 and result["context"] == 5 and result["quantize"] == "none"
    assert result["compiled"] is False and result["read_gb_s"] > 0
    assert result["floor_ms"] == pytest.approx(1e3 * result["weight_mb"] * 1e6 / (result["read_gb_s"] * 1e9))
    assert result["x_floor"] == pytest.approx(result["ms"] / result["floor_ms"])


@pytest.mark.parametrize("tied", [True, False])
def test_a_step_reads_every_weight_but_the_embedding_table(tied: bool) -> None:
    config = ModelConfig.preset("tiny-gqa").replace(vocab_size=50, tie_word_embeddings=tied)
    model = Transformer(config).init_random(seed=0)
    if tied:
        assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    table = 0 if tied else model.tok_embeddings.weight.nbytes  # a tied table is the head, read whole
    everything = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    assert one_token_step.step_weight_bytes(model) == everything - table


def test_w7a8_weights_kept_packed_are_counted() -> None:
    model = quantize_embedding(quantize_linears(tiny_model(vocab=50), "w7a8"), group_size=16)  # as the demo model runs
    packed = [m for m in model.modules() if isinstance(m, W7A8Linear)]
    assert packed
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for m in model.modules() if m not in set(model.tok_embeddings.modules())
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    expected = sum(tensors.values()) + sum(m.in_features * m.out_features for m in packed)
    assert one_token_step.step_weight_bytes(model) == expected


@pytest.mark.parametrize("main", [one_token_step.main, compile_regions.main])
@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--context", "x"], "expected a whole number, got 'x'"),
    (["--quantize", "int3"], "invalid choice: 'int3'"),
    (["--ckpt", "/nowhere/model.gguf"], "checkpoint not found: /nowhere/model.gguf"),
])
def test_bad_input_ends_in_one_line(main, argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
