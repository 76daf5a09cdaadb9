"""Device and dtype policy, and prepacked weights for multi-token steps on the CPU.

A CPU matrix multiply of a few rows by a large weight spends much of its time re-laying out ("packing") the weight
on every call; for one row (a plain decoding step) the library uses a matrix-vector product that needs no packing.
Lookahead steps feed 4 to 60 rows, where that packing is pure overhead. Keeping a copy of each weight prepacked by
oneDNN makes such steps 15-25% cheaper on a 2-core x86 CPU (measured on SmolLM2-135M, float32), at the price of a
second copy of the weights in memory. One- and two-row inputs keep using the plain weight, which is faster there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import Transformer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 where the hardware computes in it natively; float32 on CPUs that would only emulate it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return torch.bfloat16
    return torch.float32


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)} or auto") from None


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Prepacking pays for float32 on CPUs with oneDNN (for bfloat16 without native support it does not)."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """A linear layer with its weight also kept in oneDNN's prepacked layout, used from `min_rows` input rows on."""

    def __init__(self, linear: nn.Linear, min_rows: int = 3, rows_hint: int = 16) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.min_rows = min_rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])


def pack_linears(model: Transformer, min_rows: int = 3) -> Transformer:
    """Give every linear layer of the model (attention, MLP, output head) a prepacked copy of its weight."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child, min_rows))
    return model
