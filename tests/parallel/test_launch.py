"""`torchrun --nproc-per-node 2 -m minilade.generate ...`: rank 0 reads the prompt from stdin and alone writes the
text and the statistics, which are those of a single process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import write_tiny_checkpoint
from tests.parallel.ranks import ROOT, free_port

pytest.importorskip("transformers")


def generate(*launcher: str, ckpt, strategy: str) -> subprocess.CompletedProcess:
    args = ["-m", "minilade.generate", "--ckpt", str(ckpt), "--dtype", "float32", "--device", "cpu",
            "--max-new-tokens", "12", "--strategy", strategy, "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *launcher, *args], input="hello world a b", capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


def test_torchrun_on_two_ranks_prints_once_what_one_process_prints(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, "a b c d hello world", max_positions=64)
    one = generate(ckpt=ckpt, strategy="autoregressive")
    assert one.returncode == 0, one.stderr
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()))
    two = generate(*torchrun, ckpt=ckpt, strategy="lookahead")
    assert two.returncode == 0, two.stderr
    lines = two.stdout.strip().splitlines()
    assert len(lines) == 1, two.stdout  # one JSON object: rank 1 wrote nothing
    assert lines[0].split('"stats"')[0] == one.stdout.strip().split('"stats"')[0]  # same text and token ids
