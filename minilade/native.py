"""C++ operators built on the machine that runs them (torch.utils.cpp_extension): once a machine, torch and Python
version, in a folder of their own under torch's extensions folder (the native layer 20 s on a 2-core Zen 3, the others
a few seconds), with a line on stderr while the compiler runs.

A build is one torch's ABI (cpp_extension keys its builds on the source only, hence a folder per torch and Python
version) and, where it is compiled for this processor (-march=native), one processor's instructions (a folder per
processor too: a home folder can outlive its machine).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path

import torch

from .errors import one_line
from .memo import processor

STALE_BUILD_LOCK_S = 600  # a build takes seconds: a lock this old was left by a killed one


def build_folder(name: str, for_processor: bool = False) -> Path:
    """Where the operator `name` is built: a folder per torch and Python version (and processor, where asked)."""
    from torch.utils import cpp_extension
    machine = f"_{hashlib.sha256(processor().encode()).hexdigest()[:8]}" if for_processor else ""
    folder = re.sub(r"\W", "_", f"minilade_{name}_torch_{torch.__version__}_py{sys.version_info[0]}"
                                f"{sys.version_info[1]}{machine}")
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / folder


def build(name: str, source: Path, cflags: list[str], *, what: str, for_processor: bool = False) -> str | None:
    """Build (or find built) and load the operators of one C++ source, which register themselves with torch's
    dispatcher as they load; `what` names them in messages. Returns None when they are loaded, else why not, in one
    line."""
    from torch.utils import cpp_extension
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return f"no ninja to build the C++ {what} operator with"
    folder = build_folder(name, for_processor)
    building = not built(folder, source)  # the C++ compiler runs for seconds: a line says so
    if building:
        print(f"minilade: building the C++ {what} operator for this machine (once)...", end="", file=sys.stderr,
              flush=True)
    start = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = folder / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_BUILD_LOCK_S:  # left by a killed build,
            lock.unlink(missing_ok=True)  # which cpp_extension would wait for forever
        cpp_extension.load(name=folder.name, sources=[str(source)], build_directory=str(folder),
                           is_python_module=False, extra_cflags=cflags)
    except Exception as error:  # a build fails with whatever its compiler or loader raises
        if building:
            print(" failed", file=sys.stderr)
        return f"the C++ {what} operator did not build: {one_line(error)[:300]}"
    if building:
        print(f" {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return None


def built(folder: Path, source: Path) -> bool:
    """Whether folder holds a build of source at least as new as the source and the headers beside it, which
    loading it then does not build again."""
    library = folder / f"{folder.name}.so"
    if not library.exists():
        return False
    return library.stat().st_mtime >= max(path.stat().st_mtime for path in [source, *source.parent.glob("*.h")])
