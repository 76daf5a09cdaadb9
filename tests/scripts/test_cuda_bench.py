"""scripts/bench/cuda.py, run on the CPU at tiny sizes: the record it writes on a GPU machine."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench import cuda


def test_records_exactness_and_step_costs(tmp_path: Path) -> None:
    out = tmp_path / "cuda.json"
    argv = ["--device", "cpu", "--preset", "tiny-gqa", "--check-layers", "1", "--prompts", "2", "--new-tokens", "12",
            "--context", "16", "--rounds", "1", "--out", str(out)]
    assert cuda.main(argv) == 0
    record = json.loads(out.read_text())
    assert "errors" not in record
    for label, backends in record["exactness"].items():
        exact = backends["exact"]
        assert exact["invariant"] is True, label  # make_exact passes on the CPU
        assert exact["identical"] == {"lookahead": 2, "auto": 2}, label
        assert exact["forward_passes"]["plain"] == 2 * 11  # the first token comes from the prefill
    cost = record["cost"]
    assert cost["exact_check"]["invariant"] is True and cost["floor_ms"] > 0
    assert set(cost["stock"]) == set(cost["exact"]) == {str(T) for T in cuda.STEP_ROWS}
