"""A rank that fails, disagrees or is missing ends every running rank with one clear line, within the timeout."""

from __future__ import annotations

import time

from tests.helpers import write_tiny_checkpoint
from tests.parallel.ranks import run_ranks

WORDS = "the cache keeps the keys and the values of the tokens it has seen"


def error_lines(finished) -> list[str]:
    """The last stderr line of each rank, after checking that every rank failed with status 2 and one line."""
    lines = []
    for rank, f in enumerate(finished):
        assert f.returncode == 2, f"rank {rank}: exit {f.returncode}\n{f.stderr[-2000:]}"
        last = f.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "Traceback" not in f.stderr, f.stderr[-2000:]
        lines.append(last)
    return lines


def test_a_rank_that_cannot_open_its_checkpoint_stops_every_rank(tmp_path):
    good = write_tiny_checkpoint(tmp_path, WORDS, max_positions=64)
    lines = error_lines(run_ranks(2, "llm_per_rank", tmp_path, str(good), str(tmp_path / "missing.gguf")))
    for line in lines:
        assert "failed on rank 1 (of 2)" in line and "missing.gguf" in line


def test_ranks_with_different_checkpoints_stop(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = write_tiny_checkpoint(tmp_path / "a", WORDS, max_positions=64)
    b = write_tiny_checkpoint(tmp_path / "b", WORDS, max_positions=96)  # another context length
    for line in error_lines(run_ranks(2, "llm_per_rank", tmp_path, str(a), str(b))):
        assert f"rank 1 opened {b}, which is not the checkpoint rank 0 opened" in line


def test_a_missing_peer_ends_the_wait_after_the_timeout(even_checkpoint, tmp_path):
    start = time.monotonic()
    (line,) = error_lines(run_ranks(2, "logits", tmp_path, str(even_checkpoint), ranks=range(1),
                                    group_timeout_s=3.0, timeout_s=40))
    assert "did not all join within 3 s" in line
    assert time.monotonic() - start < 30


def test_a_rank_that_dies_mid_run_ends_the_others(even_checkpoint, tmp_path):
    finished = run_ranks(2, "peer_dies", tmp_path, str(even_checkpoint), group_timeout_s=5.0, timeout_s=40)
    assert finished[1].returncode == 3
    (line,) = error_lines(finished[:1])
    assert line.startswith("error: rank 0: ") and "a peer rank exited or did not answer in time" in line
