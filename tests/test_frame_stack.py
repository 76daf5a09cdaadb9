import sys

import pytest

from minilade.frame_stack import on_fresh_frame_chunk

resource = pytest.importorskip("resource")


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def small(i: int) -> int:
    return i + 1


def many_small_calls() -> int:
    """What a model pass does: many calls of small Python functions from one depth."""
    total = 0
    for i in range(2000):
        total = small(total)
    return total


def most_faults(run, depths: range) -> int:
    """The most page faults `run` takes at any of these caller depths."""
    def at_depth(k: int) -> int:
        if k:
            return at_depth(k - 1)
        before = faults()
        assert run() == 2000
        return faults() - before
    return max(at_depth(k) for k in depths)


def test_passes_arguments_and_returns_the_result():
    assert on_fresh_frame_chunk(lambda a, b=0: a - b, 5, b=2) == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults as Linux does")
def test_calls_cost_the_same_at_every_caller_depth():
    depths = range(0, 400)
    bare = most_faults(many_small_calls, depths)
    if bare < 1000:
        pytest.skip(f"this interpreter does not free frame chunks between calls ({bare} faults at worst)")
    assert most_faults(lambda: on_fresh_frame_chunk(many_small_calls), depths) < 50
