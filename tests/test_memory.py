"""minilade/memory.py: handing back the pages loading freed, and the garbage collector paused while loading."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import pytest

from minilade import memory


def test_returning_freed_memory_asks_glibc_and_is_harmless_without_it(monkeypatch) -> None:
    """LLM.load ends by handing the allocator's free pages back (memory.return_freed_memory): through glibc's
    malloc_trim where the C library has it, nothing (and no error) where it has not."""
    asked = []

    class Glibc:
        def malloc_trim(self, pad: int) -> int:
            asked.append(pad)
            return 1

    monkeypatch.setattr(memory.sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Glibc())
    memory.return_freed_memory()
    assert asked == [0]

    def no_such_library(name: str):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_such_library)
    memory.return_freed_memory()  # returns quietly
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # a C library without malloc_trim
    memory.return_freed_memory()


def test_collection_paused_leaves_the_collector_as_it_found_it() -> None:
    """memory.collection_paused (minilade's import, LLM.load) pauses the cyclic collector for its block only: on
    again after it, after an error in it too, and still off where the caller had turned it off."""
    assert gc.isenabled()
    with memory.collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), memory.collection_paused():
        raise ValueError("a load that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with memory.collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    run = subprocess.run([sys.executable, "-c", "import minilade, gc; print(gc.isenabled())"], capture_output=True,
                         text=True, check=True)
    assert run.stdout.strip() == "True"  # importing minilade leaves the collector on
