"""Q4_0, Q4_1 and Q8_0 dequantized in torch (minilade.checkpoints.gguf_blocks): the same float32 bits as
gguf.quants.dequantize, on any block bytes, on the demo file's tensors, and through the loader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from minilade.checkpoints.gguf_blocks import BLOCK_BYTES, BLOCK_TYPES, dequantize_blocks
from minilade.checkpoints.gguf_file import read_gguf_file

TYPES = sorted(BLOCK_TYPES, key=lambda q: q.name)


def same_bits(got: torch.Tensor, want: np.ndarray) -> bool:
    """Equal bit patterns, except that any NaN equals any NaN (conversions may set a NaN's quiet bit)."""
    want = torch.from_numpy(np.ascontiguousarray(want))
    nan = torch.isnan(want)
    return (got.shape == want.shape and torch.equal(torch.isnan(got), nan)
            and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_any_block_bytes_dequantize_as_gguf(qtype: QType) -> None:
    """Random bytes: every float16 scale there is (negative, subnormal, -0.0, infinite, NaN) and every code."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (40, 6 * BLOCK_BYTES[qtype]), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # infinite scales times zero codes
        want = gguf.quants.dequantize(data, qtype)
    assert same_bits(dequantize_blocks(data, qtype), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_quantized_weights_dequantize_as_gguf(qtype: QType) -> None:
    rng = np.random.default_rng(1)
    data = gguf.quants.quantize((rng.standard_normal((3, 16, 96)) * 0.05).astype(np.float32), qtype)
    got = dequantize_blocks(data, qtype)
    assert got.shape == (3, 16, 96) and same_bits(got, gguf.quants.dequantize(data, qtype))


def test_the_demo_files_block_tensors_dequantize_as_gguf(smollm2_gguf: Path) -> None:
    tensors = [t for t in read_gguf_file(smollm2_gguf).tensors if t.tensor_type in BLOCK_TYPES]
    assert {t.tensor_type for t in tensors} == {QType.Q4_1, QType.Q8_0}
    for tensor in tensors[:12] + [t for t in tensors if t.tensor_type == QType.Q8_0]:
        assert same_bits(dequantize_blocks(tensor.data, tensor.tensor_type),
                         gguf.quants.dequantize(tensor.data, tensor.tensor_type)), tensor.name
