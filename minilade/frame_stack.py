"""Python calls whose speed does not depend on how deep the caller's stack is.

CPython (3.11, measured here) keeps a thread's Python frames in chunks of 16 KiB and frees a chunk as soon as the first
frame in it returns. Code that calls a small Python function many times in a row from one depth pays nothing for
this, unless that depth puts the calls just across a chunk boundary: then every call maps a chunk, faults its pages
in and unmaps it again. A model pass makes thousands of such calls (eager modules, the w7a8 operator, a compiled
graph's Python wrapper calling operators), and whether they straddle a boundary depended on who called: measured on
the demo model, the same w7a8 steps took 26-31 ms inside auto's drafted steps and 18-20 ms replayed from a shallower
caller (60 mmap/munmap pairs a step, seen with strace), and eager plain decoding called from 87-105 frames deep took
30-40 ms a step against 28 from elsewhere, with thousands of page faults a generation. `on_fresh_frame_chunk` puts
a call's frames at the start of a chunk of their own, so they find the same room whatever the depth above.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

Result = TypeVar("Result")

# Value-stack slots of 8 bytes reserved by on_fresh_frame_chunk's frame: more than a 16 KiB chunk holds, so the frame
# never fits in its caller's chunk and opens a new one of 32 KiB, leaving some 15 KiB to the frames it calls.
FRESH_CHUNK_SLOTS = 2100


def on_fresh_frame_chunk(fn: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
    """fn(*args, **kwargs), its frames on a chunk of the frame stack of their own (the module docstring says why).
    Costs about 10 microseconds a call: the chunk mapped, its first pages faulted in, then unmapped."""
    return fn(*args, **kwargs)


# The frame is made large by its value stack's size, which the interpreter reserves on every call without using it.
on_fresh_frame_chunk.__code__ = on_fresh_frame_chunk.__code__.replace(co_stacksize=FRESH_CHUNK_SLOTS)
