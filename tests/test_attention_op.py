"""attention_op.py: the C++ operator that ends a compiled step's attention gives chunked_attention's sums, and a
row's bits depend on nothing but the row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minilade import attention_op
from minilade.compiled import chunked_attention, graph_layout, step_attention
from minilade.invariance import key_layout, value_columns

G, HKV = 3, 2


@pytest.fixture(scope="module", autouse=True)
def operator() -> None:
    missing = attention_op.load()
    if missing and missing.startswith("no ninja"):
        pytest.skip(missing)
    assert missing is None and attention_op.loaded()


def cache(D: int, slots: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (1, HKV, slots, D) and values (1, HKV, slots, value_columns(D)) as PaddedKVCache holds them (a column
    of ones after the values, zeros after it), cut from a longer buffer as a step's views are."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HKV, slots + 64, D, generator=g)
    values = torch.zeros(1, HKV, slots + 64, value_columns(D))
    values[..., :D] = torch.randn(1, HKV, slots + 64, D, generator=g)
    values[..., D] = 1
    return keys[:, :, :slots], values[:, :, :slots]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, past: int,
           attention=step_attention) -> torch.Tensor:
    """A step's attention for rows q (1, G * HKV, T, D) that see `visible` (T, past + T) of the slots."""
    layout = graph_layout(key_layout(visible, past, G, torch.float32))
    return attention(q, keys[:, :, :layout[0].shape[-1]], values[:, :, :layout[0].shape[-1]], *layout)


def causal(T: int, past: int) -> torch.Tensor:
    return torch.cat([torch.ones(T, past, dtype=torch.bool), torch.ones(T, T, dtype=torch.bool).tril()], 1)


def tree(T: int, past: int) -> torch.Tensor:
    """Rows that see the past and, among the step's rows, themselves and every other row before them (a draft tree's
    branches): keys past the first chunk boundary in tail chunks of their own."""
    rows = torch.arange(T)
    step = (rows[None] <= rows[:, None]) & ((rows[:, None] - rows[None]) % 2 == 0)
    return torch.cat([torch.ones(T, past, dtype=torch.bool), step], 1)


@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("mask", [causal, tree])
def test_it_gives_chunked_attentions_sums(D: int, mask) -> None:
    T, past = 7, 150
    keys, values = cache(D, 256)
    q = torch.randn(1, G * HKV, T, D, generator=torch.Generator().manual_seed(1))
    got = attend(q, keys, values, mask(T, past), past)
    want = attend(q, keys, values, mask(T, past), past, attention=chunked_attention)
    assert got.shape == want.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("D", [16, 64])
def test_a_rows_bits_are_those_of_its_one_row_step(D: int) -> None:
    """Each row of a causal step of 9 rows gets, bit for bit, what a one-row step at its position gets (the keys
    of the rows before it in the cache, as plain decoding has them), whatever the slots the step's layout covers."""
    T, past = 9, 120
    keys, values = cache(D, 256)
    q = torch.randn(1, G * HKV, T, D, generator=torch.Generator().manual_seed(2))
    wide = attend(q, keys, values, causal(T, past), past)
    for t in range(T):
        alone = attend(q[:, :, t:t + 1], keys, values, causal(1, past + t), past + t)
        assert torch.equal(wide[:, :, t:t + 1], alone), t


@pytest.mark.parametrize("D", [16, 64])
def test_more_rows_beside_a_row_leave_its_bits(D: int) -> None:
    """A draft tree's rows (tail chunks picked per row) give the same bits in a step of 5 rows and of 12."""
    past = 130
    keys, values = cache(D, 256)
    q = torch.randn(1, G * HKV, 12, D, generator=torch.Generator().manual_seed(3))
    few = attend(q[:, :, :5], keys, values, tree(5, past), past)
    many = attend(q, keys, values, tree(12, past), past)
    assert torch.equal(few, many[:, :, :5])


FAILED_BUILD = """
from minilade import attention_op
attention_op.native.build = lambda *args, **kwargs: "the C++ attention operator did not build: a test's"
print(attention_op.load())
print(attention_op.loaded())
"""


def test_an_operator_that_does_not_build_says_why_and_leaves_steps_to_torch() -> None:
    done = subprocess.run([sys.executable, "-c", FAILED_BUILD], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["the C++ attention operator did not build: a test's", "False"]
