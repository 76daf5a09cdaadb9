"""scripts/bench/serve_trace.py: requests through the engine in this process, every pass logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench import serve_trace


def test_each_strategy_is_traced_and_its_answers_compared(tiny_checkpoint, data_dir, kept_tables, tmp_path: Path,
                                                          capsys) -> None:
    argv = ["--ckpt", str(tiny_checkpoint), "--data", str(data_dir), "--set", "mt_bench", "--requests", "2",
            "--rounds", "2", "--max-tokens", "6", "--shapes-keys", "20", "--strategies", "autoregressive",
            "lookahead", "--no-progress", "--out-dir", str(tmp_path)]
    assert serve_trace.main(argv) == 0
    record = json.loads((tmp_path / "serve_trace.json").read_text())
    assert list(record["pass_shapes_ms"]) == list(serve_trace.SHAPES)
    assert all(ms > 0 for ms in record["pass_shapes_ms"].values())
    results = record["results"]
    assert list(results) == ["autoregressive", "lookahead"]
    for row in results.values():
        assert row["identical"] == row["answers"] == 4  # greedy: every strategy's answers are plain decoding's
        assert 1 <= row["passes"] < row["call_steps"] <= 2 * row["passes"]  # the two requests shared passes
        assert 0 <= row["tail_time_share"] <= row["pass_time_share"] <= 1
    assert "| lookahead |" in capsys.readouterr().out


def test_summary_arithmetic() -> None:
    run = {"seconds": 2.0, "answers": [[1, 2, 3], [4]], "passes": [(2, 5, 0.5), (2, 2, 0.3), (1, 1, 0.2)]}
    row = serve_trace.summary(run, requests=2)
    assert row["tokens_per_s"] == 2.0 and row["passes"] == 3 and row["call_steps"] == 5
    assert row["tokens_per_call_step"] == pytest.approx(0.8) and row["rows_per_pass"] == pytest.approx(8 / 3)
    assert row["ms_per_full_pass"] == pytest.approx(400.0) and row["ms_per_pass"] == pytest.approx(1000 / 3)
    assert row["tail_passes"] == 1 and row["tail_time_share"] == pytest.approx(0.1)
    assert row["pass_time_share"] == pytest.approx(0.5)


def test_bad_counts_are_one_line(stderr_line) -> None:
    assert serve_trace.main(["--requests", "0"]) == 2
    assert "--requests" in stderr_line()
    assert serve_trace.main(["--shapes-keys", "-1"]) == 2
    assert "--shapes-keys" in stderr_line()
