"""scripts/bench/row_cost.py: a step's extra rows against its weight matmuls and its attention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minilade.config import ModelConfig
from minilade.device import make_exact
from minilade.model import Transformer
from scripts.bench import row_cost


def test_every_row_count_times_the_step_and_its_parts(tmp_path: Path, capsys) -> None:
    argv = ["--preset", "tiny-gqa", "--context", "70", "--rows", "5", "2", "--rounds", "1", "--no-progress",
            "--out-dir", str(tmp_path)]
    assert row_cost.main(argv) == 0
    record = json.loads((tmp_path / "row_cost.json").read_text())
    assert record["exact"] is True and record["context"] == 70
    results = record["results"]
    assert [r["rows"] for r in results] == [1, 2, 5]  # one row always, as the base of the ratios
    for r in results:
        assert all(r[part] > 0 for part in row_cost.PARTS)
        assert r["rest"] == pytest.approx(r["step"] - r["matmuls"] - r["attention"])
    assert results[0]["extra_rows_gflops"] is None
    out = capsys.readouterr().out
    assert row_cost.table_row(results[2], results[0]) in out
    assert (tmp_path / "row_cost.png").stat().st_size > 0


def test_matmuls_cover_every_linear_layer_of_the_step() -> None:
    model = Transformer(ModelConfig.preset("tiny-gqa")).init_random().eval()
    make_exact(model, warn=False)
    _, parameters = row_cost.weight_matmuls(model, 3)
    c = model.config
    per_layer = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim \
        + 3 * c.dim * c.intermediate_size
    assert parameters == c.n_layers * per_layer + c.vocab_size * c.dim  # the (tied) output head once


def test_attention_alone_reads_what_the_step_reads(monkeypatch) -> None:
    """The attention part runs once per layer over the keys, values and key layout that the step's own
    attention gets (the cache the step wrote), so it times the same work."""
    import minilade.invariance

    model = Transformer(ModelConfig.preset("tiny-gqa")).init_random().eval()
    make_exact(model, warn=False)
    seen: dict[str, list] = {"step": [], "attention": []}

    def recording(part: str):
        def attention(q, keys, values, layout):
            seen[part].append((q.shape, keys.clone(), values.clone(), layout))
            return torch.zeros_like(q)
        return attention

    with torch.inference_mode():
        parts = row_cost.step_parts(model, 9, 6)
        monkeypatch.setattr(minilade.invariance, "invariant_attention", recording("step"))
        monkeypatch.setattr(row_cost, "invariant_attention", recording("attention"))
        parts["step"]()
        parts["attention"]()
    assert len(seen["step"]) == len(seen["attention"]) == model.config.n_layers
    for (q1, k1, v1, layout1), (q2, k2, v2, layout2) in zip(seen["step"], seen["attention"]):
        assert q1 == q2 and torch.equal(k1, k2) and torch.equal(v1, v2)
        assert layout1.keys == layout2.keys and torch.equal(layout1.key_bias, layout2.key_bias)


def test_extra_rows_rate_arithmetic() -> None:
    # 1e9 parameters, 3 extra rows: 6e9 flops in 0.5 s above one row = 12 GFLOPS
    assert row_cost.extra_rows_gflops(10**9, 4, 1.5, 1.0) == pytest.approx(12.0)
    assert row_cost.extra_rows_gflops(10**9, 1, 1.0, 1.0) is None
    assert row_cost.extra_rows_gflops(10**9, 4, 0.9, 1.0) is None  # not slower than one row: no rate


@pytest.mark.parametrize("argv, message", [
    (["--preset", "nope"], "invalid choice: 'nope'"),
    (["--preset", "tiny-gqa", "--context", "250", "--rows", "8"], "need 258 positions; the tiny-gqa shape has 256"),
    (["--rows", "0"], "--rows"),
])
def test_bad_options_end_in_one_line(argv: list[str], message: str, capsys) -> None:
    assert row_cost.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
