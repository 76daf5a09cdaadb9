"""The process's memory: the most it has held resident, and handing back what loading freed."""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")


def peak_memory() -> int | None:
    """The most memory this process has held resident so far, in bytes (the kernel's ru_maxrss: loading, the
    caches and every generation included); None where the platform does not say (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (a context manager or a decorator), then as it was.
    Importing torch and loading a model make some 190k objects that live as long as the process, and the automatic
    collections their making sets off scan them all again and again: 460 young, 41 middle and 3 full collections
    while the demo model's CLI started, 0.2 s of its 3, collecting 7k objects in all. The few cycles made meanwhile
    are collected by the first collection after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def returning_freed_memory(load: Callable[..., T]) -> Callable[..., T]:
    """`load`, then return_freed_memory(), once load's temporaries went with its frame."""
    @functools.wraps(load)
    def loaded(*args: Any, **kwargs: Any) -> T:
        result = load(*args, **kwargs)
        return_freed_memory()
        return result
    return loaded


def return_freed_memory() -> None:
    """Give the pages the C allocator holds free back to the system (glibc's malloc_trim). Loading frees a few hundred
    MB of temporaries (float weights read before they were quantized, the packing threads' buffers), which glibc
    otherwise keeps for later allocations: the demo model's process was 781 MB resident after loading, 545 MB with
    them returned. Nothing where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library (musl): nothing to ask
        return
