"""Small JSON tables kept per machine between runs (measured step costs, what the invariance check found).

A table maps a key (the model's shape, dtype, device, torch build) to what was measured for it. A file that
cannot be written only costs a new measurement next time; a file that is not such a table is never overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_table(path: str | Path) -> dict[str, Any] | None:
    """The table in `path`: {} when there is no file yet, None when the file is not a JSON object."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def write_entry(path: str | Path, key: str, value: Any) -> None:
    """Set table[key] = value in `path`, atomically (a temporary file renamed over it)."""
    path = Path(path)
    table = read_table(path)
    if table is None:
        raise ValueError(f"{path} is not a table minilade keeps; refusing to overwrite it (choose another file)")
    table[key] = value
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a table that cannot be written only costs a new measurement next time
