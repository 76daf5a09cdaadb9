"""GGUF's 4-bit blocks as torch int4 weights, code for code, without a float detour.

llama.cpp's Q4_0 and Q4_1 store each row in blocks of 32 weights: a float16 scale d (Q4_1: and a float16 minimum
m), then 16 bytes whose low nibbles are weights 0-15 and high nibbles weights 16-31 (gguf-py's quants.py):
    Q4_0: w = d * (q - 8)        Q4_1: w = d * q + m        q in [0, 15]
torch's int4 layout (quant.Int4Weight) is w = (q - 8) * scale + zero with a group of 32, so the codes carry over
unchanged, with scale = d and zero = -0.0 (Q4_0) or zero = m + 8 d (Q4_1). With float32 scales this is exact:
d * (q - 8) is exact in float32 (11-bit by 4-bit), m + 8 d is exact for every block checked (see
`exact_zero_points`), and the kernel's single rounding of (q - 8) * d + (m + 8 d) is gguf-py's rounding of
d * q + m. The fast (bfloat16) kernels need the scales in bfloat16, which keeps only 8 of float16's 11 significant
bits: exact there only for the blocks whose d and zero happen to fit (`bfloat16_exact_fraction`).
Q8_0 (blocks of 32 int8 codes with a float16 scale each, w = d * q) maps onto no torch matmul kernel
(`_weight_int8pack_mm` has one scale per output channel), but it is exactly quant.Int8GroupWeight, which the
quantized token embedding looks rows up in (`int8_from_q8_0`). Q8_0 linear layers and the K-quants are dequantized
by gguf.py as before.
"""

from __future__ import annotations

from typing import Collection

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from ..errors import CheckpointError
from ..quant import Int4Weight, Int8GroupWeight, cat_rows, map_rows
from .gguf import GGUFTensors, unpermute_rotary
from .gguf_blocks import as_blocks, float16_at, unpack_nibbles
from .names import checkpoint_tensors

INT4_TYPES = frozenset({QType.Q4_0, QType.Q4_1})


def int4_from_blocks(data: np.ndarray, kind: QType) -> Int4Weight:
    """GGUF rows of Q4_0 / Q4_1 blocks, (N, bytes per row) uint8 as GGUFReader gives them, as an Int4Weight
    (N, K) with group 32 and float32 scales, in the file's row order. Raises ValueError for any other type."""
    if kind not in INT4_TYPES:
        raise ValueError(f"type {kind.name} has no exact int4 mapping (only Q4_0 and Q4_1 have)")
    n_rows = np.shape(data)[0]
    blocks = as_blocks(data, kind)  # (N, G, bytes)
    d = float16_at(blocks, 0)[..., 0]  # (N, G)
    # Q4_0's zero point is -0.0, not 0.0: with a negative d, gguf-py's d * 0 is -0.0, and only x + (-0.0)
    # leaves every x, including -0.0, unchanged bit for bit.
    zeros = float16_at(blocks, 2)[..., 0] + 8 * d if kind == QType.Q4_1 else torch.full_like(d, -0.0)
    return Int4Weight(unpack_nibbles(blocks, kind, torch.uint8).reshape(n_rows, -1), d, zeros)


def int8_from_q8_0(data: np.ndarray) -> Int8GroupWeight:
    """GGUF rows of Q8_0 blocks (float16 d, then 32 int8 codes), (N, bytes per row) uint8, as an Int8GroupWeight
    (N, K) with group 32 and the scales in float32: every weight d * q exactly as gguf-py dequantizes it."""
    n_rows = np.shape(data)[0]
    blocks = as_blocks(data, QType.Q8_0)  # (N, G, 34)
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(n_rows, -1)
    return Int8GroupWeight(codes, float16_at(blocks, 0).reshape(n_rows, -1))


def gguf_embedding(source: GGUFTensors) -> Int8GroupWeight | None:
    """The file's token embedding as int8 groups when it is stored as Q8_0 (code for code), else None."""
    table = checkpoint_tensors(source.config).values()
    canonical = next(spec.canonical for spec in table if spec.ours == "tok_embeddings.weight")
    tensor = source.by_name.get(canonical)
    if tensor is None or tensor.tensor_type != QType.Q8_0:
        return None
    return int8_from_q8_0(tensor.data)


def exact_zero_points(data: np.ndarray, kind: QType) -> bool:
    """Whether every Q4_1 block's zero point m + 8 d came out exact in float32 (then the mapping is exact);
    True for Q4_0, whose zero point is 0."""
    if kind != QType.Q4_1:
        return True
    weight = int4_from_blocks(data, kind)
    m = weight.zeros.double() - 8 * weight.scales.double()
    return bool(torch.equal(m, float16_at(as_blocks(data, kind), 2).reshape(m.shape).double()))


def bfloat16_exact_fraction(weight: Int4Weight) -> float:
    """Fraction of groups whose scale and zero point survive rounding to bfloat16 unchanged."""
    fits = [(t.to(torch.bfloat16).float() == t) for t in (weight.scales, weight.zeros)]
    return float((fits[0] & fits[1]).float().mean())


def gguf_int4_weights(source: GGUFTensors, modules: Collection[str]) -> dict[str, Int4Weight]:
    """Our module name ("layers.0.attention.wqkv") -> its weight from the file's 4-bit blocks, for each of
    `modules` (the model's linear layers: quant.linear_modules) whose parts are all Q4_0 / Q4_1: Q/K rows
    un-permuted to the rotate-half layout, fused parts stacked in slot order. The others (float, Q8_0, K-quants,
    a head tied to the embedding) are absent: quantize_linears quantizes them from their float weights. A block whose
    scale or minimum is not finite (a corrupted file) raises CheckpointError, as Checkpoint.tensors does."""
    wanted = {f"{name}.weight" for name in modules}
    specs = [s for s in checkpoint_tensors(source.config).values() if s.ours in wanted]
    parts: dict[str, dict[int, Int4Weight]] = {}
    for spec in specs:
        tensor = source.by_name[spec.canonical]
        if tensor.tensor_type not in INT4_TYPES:
            continue
        weight = int4_from_blocks(tensor.data, tensor.tensor_type)
        if not (torch.isfinite(weight.scales).all() and torch.isfinite(weight.zeros).all()):
            raise CheckpointError(f"{source.path}: tensor {spec.canonical} ({source.stored_name(spec.canonical)} in "
                                  f"the file) holds NaN or infinite values")
        heads = spec.module.rotary_heads
        if heads is not None and source.permuted:
            n_heads = getattr(source.config, heads)
            weight = map_rows(weight, lambda t: unpermute_rotary(t, n_heads))
        parts.setdefault(spec.ours.removesuffix(".weight"), {})[spec.module.slot] = weight
    complete = {name: slots for name, slots in parts.items()
                if len(slots) == next(s.parts for s in specs if s.ours == f"{name}.weight")}
    return {name: cat_rows([slots[i] for i in range(len(slots))]) for name, slots in complete.items()}
