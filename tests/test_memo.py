"""Where the kept tables (minilade/memo.py) live: checkpoints.resolve.kept_tables_dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from minilade.checkpoints.resolve import default_weights_dir, kept_tables_dir


def test_kept_tables_live_where_minilade_tables_says_else_beside_the_weights(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    monkeypatch.setenv("MINILADE_TABLES", str(tmp_path / "tables"))
    assert kept_tables_dir() == tmp_path / "tables"
    monkeypatch.delenv("MINILADE_TABLES")
    monkeypatch.setenv("MINILADE_WEIGHTS", str(tmp_path / "weights"))
    assert kept_tables_dir() == default_weights_dir() == tmp_path / "weights"
