"""llama.cpp's legacy block types (Q4_0, Q4_1, Q8_0) dequantized in torch, a whole tensor at a time.

gguf.quants.dequantize does the same in numpy, 16 rows at a time on one core; this is about 4x faster on the demo
model and gives the same float32 bits: the same formulas with the same two roundings (a product, then a sum; no
fused multiply-add), from the same float16 scales. Blocks of 32 weights (gguf-py's quants.py):
    Q4_0: float16 d, 16 bytes of 4-bit codes q      w = d * (q - 8)
    Q4_1: float16 d, float16 m, 16 bytes of codes   w = d * q + m
    Q8_0: float16 d, 32 int8 codes q                w = q * d
The low nibbles of a block's 16 code bytes are weights 0-15, the high nibbles weights 16-31.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

BLOCK = 32
BLOCK_BYTES = {QType.Q4_0: 2 + BLOCK // 2, QType.Q4_1: 4 + BLOCK // 2, QType.Q8_0: 2 + BLOCK}
BLOCK_TYPES = frozenset(BLOCK_BYTES)


def dequantize_blocks(data: np.ndarray, kind: QType) -> torch.Tensor:
    """Rows of blocks, (..., bytes per row) uint8 as the GGUF reader gives them, as float32 (..., weights per row):
    bit for bit gguf.quants.dequantize(data, kind). The weights are computed in place in their one float32 buffer:
    fresh memory costs page faults, which on a first load cost more than the arithmetic."""
    outer = np.shape(data)[:-1]
    blocks = as_blocks(data, kind)  # (R, G, bytes)
    d = float16_at(blocks, 0)  # (R, G, 1)
    if kind == QType.Q8_0:
        weights = blocks[..., 2:].contiguous().view(torch.int8).float().mul_(d)
    else:
        weights = unpack_nibbles(blocks, kind, torch.float32)  # (R, G, 32)
        if kind == QType.Q4_1:
            weights.mul_(d).add_(float16_at(blocks, 2))
        else:
            weights.sub_(8).mul_(d)
    return weights.reshape(*outer, -1)


def as_blocks(data: np.ndarray, kind: QType) -> torch.Tensor:
    """Rows of blocks, (..., bytes per row) uint8, as a uint8 tensor (R, G, bytes per block): a copy, since torch
    takes no read-only memory map."""
    rows = torch.from_numpy(np.array(data).view(np.uint8))
    return rows.reshape(-1, rows.shape[-1] // BLOCK_BYTES[kind], BLOCK_BYTES[kind])


def float16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, as float32: (R, G, 1)."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def unpack_nibbles(blocks: torch.Tensor, kind: QType, dtype: torch.dtype) -> torch.Tensor:
    """The 4-bit codes q of Q4_0 / Q4_1 blocks (R, G, bytes), as (R, G, 32) in dtype: low nibbles first."""
    packed = blocks[..., BLOCK_BYTES[kind] - BLOCK // 2:]  # (R, G, 16), after the header
    codes = torch.empty(*packed.shape[:2], BLOCK, dtype=dtype)
    codes[..., :BLOCK // 2] = packed & 0x0F
    codes[..., BLOCK // 2:] = packed >> 4
    return codes
