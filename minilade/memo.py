"""Small JSON tables kept per machine between runs (measured step costs, what the invariance check found).

A table maps a key (the model's shape, dtype, device, processor, torch build) to what was measured for it. A file that
cannot be written only costs a new measurement next time; a file that is not such a table is never overwritten.
Where the files are is the caller's choice (the CLI's: checkpoints.resolve.kept_tables_dir).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import platform
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

SIMD_FLAG_PREFIXES = ("avx", "amx")  # the CPU flags that decide which matmul kernels torch can use


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
    """Set table[key] = value in `path`, atomically (a temporary file renamed over it), making its folder if need be
    (a $MINILADE_TABLES not made yet)."""
    path = Path(path)
    table = read_table(path)
    if table is None:
        raise ValueError(f"{path} is not a table minilade keeps; refusing to overwrite it (choose another file)")
    table[key] = value
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a table that cannot be written only costs a new measurement next time


_NESTING = threading.local()  # measuring()'s depth in this thread


@contextlib.contextmanager
def measuring(what: str, table: str | Path | None) -> Iterator[None]:
    """Around a measurement that will be kept in `table`: one line on stderr saying what is measured (a first run on
    a machine spends some 20 s measuring the demo model), unless it is not to be kept (table None: it is measured at
    every load, as the caller asked) or it is part of a measurement already announced."""
    depth = getattr(_NESTING, "depth", 0)
    if table is not None and depth == 0:
        print(f"minilade: measuring {what} on this machine (once: kept in {Path(table).parent})", file=sys.stderr,
              flush=True)
    _NESTING.depth = depth + 1
    try:
        yield
    finally:
        _NESTING.depth = depth


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none); read once per process (every
    generation's step costs are looked up under a key that names the processor). Not to be modified."""
    fields: dict[str, str] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return fields
    for line in itertools.takewhile(str.strip, lines):
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def simd_flags(flags: str) -> list[str]:
    """The SIMD flags (avx*, amx*) among a space-separated flag list, sorted."""
    return sorted(f for f in flags.split() if f.startswith(SIMD_FLAG_PREFIXES))


def processor() -> str:
    """The processor a CPU figure was measured on: its model name and SIMD flags. Part of every kept table's key:
    a home folder can outlive its machine (and a virtual machine can move to another CPU model), and a processor
    with other SIMD units runs other kernels, with other costs and other rounding."""
    fields = cpu_fields()
    flags = simd_flags(fields.get("flags", ""))
    return f"{fields.get('model name') or platform.processor() or 'unknown'} [{' '.join(flags) or 'no avx/amx'}]"
