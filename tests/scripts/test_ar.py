"""scripts/bench/ar.py: the autoregressive comparison on a tiny random checkpoint, its arithmetic on records built
by hand, and the bandwidth measurement on an injected clock."""

from __future__ import annotations

import json
import statistics
from itertools import accumulate
from pathlib import Path

import pytest

from minilade.config import ModelConfig
from scripts.bench import ar
from scripts.bench.contenders import AR, HF_GENERATE, HF_PREFILL


def test_ar_compares_both_libraries_per_dtype(tiny_checkpoint: Path, data_dir: Path, tmp_path: Path,
                                              capsys) -> None:
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--quick",
            "--datasets", "humaneval", "--n-prompts", "2", "--dtypes", "float32", "bfloat16", "--bandwidth-mib", "8",
            "--no-progress", "--threads", "1"]
    assert ar.main(argv) == 0
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0] == "command: python -m scripts.bench.ar " + " ".join(argv)
    assert "memory bandwidth" in stdout
    doc = json.loads((tmp_path / "ar_results.json").read_text())
    summary = doc["summary"]
    assert [(r["dtype"], r["library"]) for r in summary] == [
        ("float32", "minilade AR"), ("float32", "transformers generate"),
        ("bfloat16", "minilade AR"), ("bfloat16", "transformers generate")]
    assert summary[0]["weight_bytes_per_token"] == 2 * summary[2]["weight_bytes_per_token"]
    assert summary[1]["exact_match"] == 2  # float32: the same tokens as transformers
    assert summary[0]["minilade_over_transformers"] == pytest.approx(paired_ratio(doc["records"], "float32"))
    assert doc["bandwidth"]["read_gb_s"] > 0 and summary[0]["measured_read_gb_s"] == doc["bandwidth"]["read_gb_s"]
    assert summary[0]["weight_gb_s"] == pytest.approx(
        summary[0]["weight_bytes_per_token"] * summary[0]["decode_tokens_per_s"] / 1e9)
    assert len(doc["records"]) == 2 * 2 * 3  # dtypes x prompts x (minilade, transformers, transformers prefill)
    assert {r["dtype"] for r in doc["records"]} == {"float32", "bfloat16"}


def paired_ratio(records: list[dict], dtype: str) -> float:
    """minilade's tokens/s over transformers', per prompt (one repetition here), median over prompts."""
    def tokens_per_s(label: str) -> dict[int, float]:
        return {r["prompt"]: r["new_tokens"] / r["wall_s"] for r in records
                if r["dtype"] == dtype and r["config"] == label}

    ours, theirs = tokens_per_s(AR), tokens_per_s(HF_GENERATE)
    return statistics.median(ours[p] / theirs[p] for p in ours)


def made_up(config: str, prompt: int, wall_s: float, ids: list[int], decode_s: float | None = None) -> dict:
    return dict(dataset="gsm8k", temperature=0.0, config=config, prompt=prompt, rep=0, wall_s=wall_s,
                decode_s=decode_s, new_tokens=len(ids), forward_passes=None, token_ids=ids, ids_sha1=str(ids))


def test_summary_arithmetic_on_records_built_by_hand() -> None:
    records = [made_up(AR, 0, 1.0, [1, 2, 3, 4, 5], decode_s=0.8), made_up(AR, 1, 1.0, [6, 7, 8], decode_s=0.2),
               made_up(HF_GENERATE, 0, 2.0, [1, 2, 3, 4, 5]), made_up(HF_GENERATE, 1, 0.5, [6, 7, 9]),
               made_up(HF_PREFILL, 0, 0.5, [1]), made_up(HF_PREFILL, 1, 0.25, [6])]
    config = ModelConfig.preset("smollm2-135m")
    bandwidth = {"buffer_mib": 8, "read_gb_s": 20.0, "copy_gb_s": 15.0}
    ours, theirs = ar.summarize(records, "float32", config, bandwidth)
    assert ours["weight_bytes_per_token"] == config.n_params * 4  # tied: the embedding is read once, as the head
    assert (ours["new_tokens"], ours["tokens_per_s"]) == (8, 4.0)
    assert ours["decode_tokens_per_s"] == pytest.approx((8 - 2) / 1.0)  # each prompt's first token is the prefill's
    assert ours["weight_gb_s"] == pytest.approx(config.n_params * 4 * 6 / 1e9)
    assert ours["minilade_over_transformers"] == pytest.approx((2 + 0.5) / 2)  # per-prompt ratios 2 and 0.5
    # transformers' decode time: each prompt's wall time minus its prefill-only time
    assert theirs["decode_tokens_per_s"] == pytest.approx((8 - 2) / (1.5 + 0.25))
    assert theirs["exact_match"] == 1 and ours["exact_match"] is None
    table = ar.ar_table([ours, theirs], bandwidth)
    assert "read 20.0 GB/s, copy (read + write) 15.0 GB/s" in table
    assert f"| float32 | minilade AR | 8 | 4.0 | 6.0 | 1.25 | {config.n_params * 4 / 1e6:.0f} |" in table
    assert f"| {ours['weight_gb_s'] / 20.0:.0%} |" in table and "| 1/2 |" in table


def test_bandwidth_is_bytes_over_the_median_time_after_a_warm_up() -> None:
    durations = [100.0, 1.0, 3.0, 2.0, 50.0, 4.0, 4.0, 5.0]  # read: warm-up then 3 reps; copy: the same
    stamps = iter(accumulate(d for duration in durations for d in (0.0, duration)))
    result = ar.measure_bandwidth(1, reps=3, clock=lambda: next(stamps))
    nbytes = 2**20
    assert result == {"buffer_mib": 1, "read_gb_s": nbytes / 2.0 / 1e9, "copy_gb_s": 2 * nbytes / 4.0 / 1e9}


def test_decode_options_are_not_ar_options(stderr_line) -> None:
    assert ar.main(["--settings", "7,5,7"]) == 2
    assert "unrecognized arguments: --settings 7,5,7" in stderr_line()
    assert ar.main(["--dtypes", "float16"]) == 2
    assert "argument --dtypes: invalid choice: 'float16'" in stderr_line()
