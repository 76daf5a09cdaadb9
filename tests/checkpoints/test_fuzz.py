"""Fuzzing the checkpoint readers (issue 10): a few hundred seeded mutations of a small GGUF file and a small
safetensors folder (scripts/fuzz_checkpoints.py; `python -m scripts.fuzz_checkpoints --mutations 5000` runs
more). Every mutation must load, or be refused with one line naming the file in a ValueError subclass from
minilade.errors, within a time bound, and the whole run within a memory bound; never another exception."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

from scripts import fuzz_checkpoints as fuzz
from scripts import fuzz_mutations as mutations

MUTATIONS = 400
SECONDS_PER_LOAD = 5.0
RSS_GROWTH_MIB = 512


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on dequantising mutated scales (then refused)
def test_every_mutation_loads_or_fails_cleanly(tmp_path: Path) -> None:
    before = fuzz.peak_rss_mib()
    outcomes = fuzz.run(MUTATIONS, seed=0, seconds=SECONDS_PER_LOAD, work=tmp_path)
    failed = [f"{o.mutation}: {o.detail}" for o in outcomes if o.result == "FAILED"]
    assert not failed, "\n".join(failed)
    assert fuzz.peak_rss_mib() - before < RSS_GROWTH_MIB
    results = collections.Counter(o.result for o in outcomes)
    # The run exercises both ends: mutations that leave a loadable file and many that must be refused.
    assert results["loaded"] >= MUTATIONS // 20 and results["refused"] >= MUTATIONS // 2, results


def test_the_fuzzer_sees_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge must be able to fail: an exception type outside minilade.errors, or a message of two lines."""
    bases = mutations.make_bases(tmp_path)
    _, path = mutations.config_value(bases, random.Random(0))

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(fuzz, "open_checkpoint", crash)
    assert fuzz.judge("crash", path, 1.0).result == "FAILED"

    def two_lines(*args: object, **kwargs: object) -> None:
        raise fuzz.errors.CheckpointError(f"{path}: first\nsecond")

    monkeypatch.setattr(fuzz, "open_checkpoint", two_lines)
    assert fuzz.judge("two lines", path, 1.0).result == "FAILED"


def test_unmutated_bases_load(tmp_path: Path) -> None:
    bases = mutations.make_bases(tmp_path)
    gguf_path = tmp_path / "plain.gguf"
    gguf_path.write_bytes(bases.gguf_bytes)
    folder = mutations.write_safetensors(tmp_path / "plain", bases.config, bases.st_bytes)
    assert fuzz.judge("none", gguf_path, 5.0).result == "loaded"
    assert fuzz.judge("none", folder, 5.0).result == "loaded"


@pytest.mark.parametrize("argv, message", [
    (["--mutations", "0"], "argument --mutations: must be >= 1, got 0"),
    (["--seconds", "0"], "argument --seconds: must be >= 0.1, got 0"),
])
def test_bad_options_end_in_one_line(argv: list[str], message: str, capsys) -> None:
    assert fuzz.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
