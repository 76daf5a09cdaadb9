"""scripts/bench/one_token_step.py: the one-token step timed alone, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench import compile_regions, one_token_step


def test_prints_one_json_line_with_the_median_step(tiny_checkpoint: Path, capsys) -> None:
    assert one_token_step.main(["--ckpt", str(tiny_checkpoint), "--context", "5", "--steps", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ms"] > 0 and result["context"] == 5 and result["quantize"] == "none"


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
