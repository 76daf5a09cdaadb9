"""scripts/bench/turns.py: a chat's turns read from the last turn's rows against read whole, its table, JSON and
plot."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench import turns


def test_turns_keep_the_last_turns_rows_and_answer_as_read_whole(tiny_checkpoint: Path, data_dir: Path,
                                                                   tmp_path: Path, capsys) -> None:
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--turns", "2", "--rounds", "2",
            "--max-new-tokens", "6", "--threads", "1", "--no-progress", "--out-dir", str(tmp_path)]
    assert turns.main(argv) == 0
    record = json.loads((tmp_path / "turns.json").read_text())
    assert len(record["rounds"]) == 2 and [r["turn"] for r in record["turns"]] == [1, 2]
    assert [r["order"][0] for r in record["rounds"][0]] == ["kept", "whole"]  # the first way alternates by turn
    assert [r["order"][0] for r in record["rounds"][1]] == ["whole", "kept"]  # and by round
    second = record["turns"][1]
    first_turn = record["rounds"][0][0]
    # the second turn resends the first prompt and answer (the answer as text, which a random model's tokens need
    # not survive): at least the first prompt's rows are kept, but for the template's last token
    assert second["kept_tokens"] >= first_turn["prompt_tokens"] - 1
    assert second["kept_tokens"] < second["prompt_tokens"]
    assert all(r[key] > 0 for r in record["turns"] for key in ("prefill_kept", "prefill_whole", "turn_whole"))
    out = capsys.readouterr().out
    assert "| turn | prompt tokens | kept |" in out and "| 2 |" in out
    assert (tmp_path / "turns.png").stat().st_size > 0
