"""minilade/memory.py: handing back the pages loading freed."""

from __future__ import annotations

import ctypes

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
