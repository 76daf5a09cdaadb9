"""scripts/bench/native_matmul.py: whole native passes and the output head with the operator's integer matmul (on
matrix tiles too, where the processor has them) and with fbgemm's call."""

from __future__ import annotations

import json
from pathlib import Path

from minilade.native_steps import has_matrix_tiles
from scripts.bench import native_matmul


def test_the_bench_times_both_kinds_of_pass_and_the_head_with_both_matmuls(tiny_checkpoint: Path, capsys) -> None:
    assert native_matmul.main(["--ckpt", str(tiny_checkpoint), "--rows", "1", "3", "--context", "8", "--rounds", "2",
                               "--reps", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("machine: ")
    rows = [line for line in lines if line.startswith("| ") and " ms" not in line and "---" not in line]
    passes = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    assert passes == ["1 row, 1 call", "1 call of 1 row", "head, 1 row", "3 rows, 1 call", "3 calls of 1 row",
                      "head, 3 rows"]
    record = json.loads(lines[-1])
    assert record["context"] == 8 and "cpu_flags" in record and list(record["ms"]) == passes
    for name, ms in record["ms"].items():
        assert ms["integer"] > 0 and ms["fbgemm"] > 0, name
        assert (ms.get("tiles", 0) > 0) == has_matrix_tiles(), name  # on matrix tiles where the processor has them
        assert (ms.get("eager", 0) > 0) == name.startswith("head"), name  # the head eagerly too
