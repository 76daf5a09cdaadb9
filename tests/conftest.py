"""Shared fixtures. Tiny random models cover most tests; the real SmolLM2-135M checkpoint a focused set."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF file (the CLI's default checkpoint)."""
    path = REPO_ROOT / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file(), f"{path} is missing"
    return path
