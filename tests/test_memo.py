"""The kept tables (minilade/memo.py): where they live (checkpoints.resolve.kept_tables_dir), how they are written,
and what a measurement kept in them says while it runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from minilade.checkpoints.resolve import default_weights_dir, kept_tables_dir
from minilade.device import make_exact
from minilade.loading import tables_dir
from minilade.memo import measuring, read_table, write_entry
from tests.helpers import tiny_model


def test_kept_tables_live_where_minilade_tables_says_else_beside_the_weights(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    monkeypatch.setenv("MINILADE_TABLES", str(tmp_path / "tables"))
    assert kept_tables_dir() == tmp_path / "tables"
    monkeypatch.delenv("MINILADE_TABLES")
    monkeypatch.setenv("MINILADE_WEIGHTS", str(tmp_path / "weights"))
    assert kept_tables_dir() == default_weights_dir() == tmp_path / "weights"


def test_a_table_in_a_folder_not_made_yet_is_kept(tmp_path: Path) -> None:
    """$MINILADE_TABLES may name a folder that does not exist yet: the first entry makes it (else nothing measured
    would ever be kept, and every run would measure again)."""
    table = tmp_path / "not" / "made" / "costs.json"
    write_entry(table, "key", {"1": 0.5})
    assert read_table(table) == {"key": {"1": 0.5}}


def test_a_kept_measurement_says_so_once_and_a_nested_one_not_at_all(tmp_path: Path, capsys) -> None:
    """make_exact's check, kept in a table: one line on stderr while it runs the first time, none once the verdict is
    kept; inside another announced measurement, and for a table of None (measured at every load, as asked), none."""
    table = tmp_path / "tables" / "invariance.json"
    assert make_exact(tiny_model(), table).exact
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"minilade: measuring whether float32 steps are batch-invariant on this machine (once: kept "
                     f"in {table.parent})"]
    assert make_exact(tiny_model(), table).exact and capsys.readouterr().err == ""
    with measuring("something larger", table):
        make_exact(tiny_model(preset="tiny-mha"), table)
    assert capsys.readouterr().err.count("\n") == 1
    make_exact(tiny_model(preset="tiny-mha"), None)
    assert capsys.readouterr().err == ""



def test_tables_that_name_a_file_are_refused(tmp_path: Path) -> None:
    """A file where the kept tables' folder should be: refused before anything is loaded or measured, not a misleading
    complaint about a table in it (the command line's: tests/test_cli.py)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match="^tables names .*afile, which is not a folder"):
        tables_dir(afile)
    assert tables_dir(tmp_path / "not-yet") == tmp_path / "not-yet"  # made when first written
