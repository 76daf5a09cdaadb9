"""Launching a test's ranks: one Python process per rank, with the environment torchrun would give it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


def run_ranks(world: int, scenario: str, folder: Path, *args: str, timeout_s: float = 90.0,
              ranks: range | None = None, group_timeout_s: float = 20.0) -> list[Finished]:
    """Run `python -m tests.parallel.worker scenario folder args...` as ranks 0..world-1 (only those in `ranks`
    are started: leaving one out is a missing peer) with one thread each and the process group's timeout
    group_timeout_s; their outcomes in rank order."""
    port = free_port()
    procs = []
    for rank in ranks if ranks is not None else range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                   TEST_TIMEOUT_S=str(group_timeout_s))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.parallel.worker", scenario, str(folder), *args],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    finished = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{scenario}: a rank was still running after {timeout_s} s (a hang)") from None
        finished.append(Finished(proc.returncode, out, err))
    return finished


def check_ok(finished: list[Finished]) -> None:
    for rank, f in enumerate(finished):
        assert f.returncode == 0, f"rank {rank} failed:\n{f.stderr[-3000:]}"


def results(folder: Path, world: int) -> list[dict]:
    """What each rank's scenario wrote, in rank order."""
    import torch

    return [torch.load(folder / f"rank{rank}.pt") for rank in range(world)]
