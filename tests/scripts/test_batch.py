"""scripts/bench/batch.py: generate_many against generate() one after another, its table, JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench import batch


def test_batch_times_every_concurrency_and_counts_identical_answers(tiny_checkpoint: Path, data_dir: Path,
                                                                      tmp_path: Path, capsys) -> None:
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--datasets", "mt_bench", "humaneval",
            "--n-prompts", "2", "--max-new-tokens", "6", "--concurrency", "2", "--rounds", "1", "--threads", "1",
            "--no-progress", "--out-dir", str(tmp_path)]
    assert batch.main(argv) == 0
    record = json.loads((tmp_path / "batch.json").read_text())
    assert [r["dataset"] for r in record["results"]] == ["mt_bench", "humaneval"]
    for result in record["results"]:
        assert result["identical"] == {"1": 4, "2": 4}  # two prompts, a warm-up round and a timed one
        assert len(result["rounds"]) == 1 and result["speedup"]["1"] == 1.0
        rates = result["rounds"][0]["tokens_per_s"]
        assert result["tokens_per_s"] == rates and set(rates) == {"1", "2"} and min(rates.values()) > 0
    out = capsys.readouterr().out
    assert "| 1 (generate, one after another) |" in out and "| 2 |" in out
    assert (tmp_path / "batch.png").stat().st_size > 0


def test_a_concurrency_below_one_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    assert batch.main(["--concurrency", "0", "--out-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
