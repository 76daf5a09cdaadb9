"""scripts/bench/exactness.py: where greedy lookahead and autoregressive outputs part."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench import exactness


def test_exactness_on_a_tiny_checkpoint(tiny_checkpoint: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "exactness.json"
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--n-prompts", "2", "--max-new-tokens", "8",
            "--settings", "2,3,2", "--out", str(out), "--no-progress"]
    assert exactness.main(argv) == 0
    table = capsys.readouterr().out
    for dataset in ("mt_bench", "humaneval", "gsm8k"):  # float32 greedy lookahead equals autoregressive
        assert f"| {dataset} | (2, 3, 2) | 2/2 | - |" in table
    doc = json.loads(out.read_text())
    assert doc["command"] == "python -m scripts.bench.exactness " + " ".join(argv) and doc["dtype"] == "float32"
    records = doc["records"]
    assert len(records) == 6 and all(r["same"] and r["first_diff"] is None for r in records)
    assert all(r["tokens"] == 8 for r in records)  # a random model does not stop early


def test_missing_data_file_is_one_line_error(tmp_path: Path, stderr_line) -> None:
    assert exactness.main(["--data-dir", str(tmp_path)]) == 2
    assert stderr_line().startswith("error: data file not found")


def test_first_difference() -> None:
    assert exactness.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert exactness.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert exactness.first_difference([1, 2, 3], [1, 2]) == 2  # one stopped early: they part where it stopped
    assert exactness.first_difference([1], [1, 2]) == 1


def test_table_lists_each_divergence_with_its_margin() -> None:
    records = [dict(dataset="gsm8k", prompt=0, setting=(7, 5, 7), same=True, first_diff=None, tokens=9),
               dict(dataset="gsm8k", prompt=1, setting=(7, 5, 7), same=False, first_diff=4, tokens=9, margin=0.125),
               dict(dataset="gsm8k", prompt=2, setting=(7, 5, 7), same=False, first_diff=9, tokens=9)]
    assert exactness.table(records).splitlines()[2] == \
        "| gsm8k | (7, 5, 7) | 1/3 | #1: token 4 (0.125), #2: token 9 (nan) |"


def test_skip_and_auto_cover_later_prompts_and_auto(tiny_checkpoint: Path, data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "chunk.json"
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--datasets", "gsm8k", "--skip", "1",
            "--n-prompts", "1", "--max-new-tokens", "6", "--settings", "2,3,2", "--auto", "--out", str(out),
            "--no-progress"]
    assert exactness.main(argv) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["prompt"], r["setting"]) for r in records] == [(1, [2, 3, 2]), (1, "auto")]
    assert all(r["same"] for r in records)


def test_negative_skip_is_one_line_error(data_dir: Path, stderr_line) -> None:
    assert exactness.main(["--data-dir", str(data_dir), "--skip", "-1"]) == 2
    assert stderr_line() == "error: --skip must be >= 0, got -1"
