"""scripts/bench/ablation.py: compression with and without the bonus token and the prompt pool."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench import ablation


def test_ablation_on_a_tiny_checkpoint(tiny_checkpoint: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "ablation.json"
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--n-prompts", "2", "--max-new-tokens", "12",
            "--settings", "2,3,2", "--out", str(out), "--no-progress"]
    assert ablation.main(argv) == 0  # every variant gave the same (exact) output
    table = capsys.readouterr().out
    assert "| minilade | no bonus token | no prompt pool | reference-like | same output |" in table
    records = json.loads(out.read_text())["records"]
    assert len(records) == 3 * 2 * 4 and all(r["same_output"] for r in records)
    capped = [r for r in records if r["variant"] in ("no bonus token", "reference-like")]
    assert all(r["most_per_step"] <= 2 for r in capped)  # N - 1 = 2: the reference's cap holds
    gsm8k = [r for r in records if r["dataset"] == "gsm8k" and r["variant"] == "minilade"]
    compression = sum(r["new_tokens"] for r in gsm8k) / sum(r["forward_passes"] for r in gsm8k)
    assert f"| gsm8k | (2, 3, 2) | {compression:.2f} |" in table
    assert ablation.main(["--data-dir", str(tmp_path)]) == 2


def test_table_sums_over_prompts_and_flags_a_different_output() -> None:
    def row(variant: str, prompt: int, new: int, passes: int, same: bool = True) -> dict:
        return dict(dataset="humaneval", prompt=prompt, setting=(7, 5, 7), variant=variant, new_tokens=new,
                    forward_passes=passes, most_per_step=4, same_output=same)

    records = [row("minilade", 0, 10, 4), row("minilade", 1, 20, 6),            # 30 / 10, not (2.5 + 3.33) / 2
               row("no bonus token", 0, 10, 5), row("no bonus token", 1, 20, 10),
               row("no prompt pool", 0, 10, 10), row("no prompt pool", 1, 20, 20),
               row("reference-like", 0, 10, 10), row("reference-like", 1, 20, 15, same=False)]
    assert ablation.table(records).splitlines()[2] == "| humaneval | (7, 5, 7) | 3.00 | 2.00 | 1.00 | 1.20 | NO |"
