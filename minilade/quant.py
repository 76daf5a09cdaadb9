"""Weight-only quantized linear layers (int8 per output channel, int4 in groups) on PyTorch's own CPU kernels, and
a token embedding kept as int8 in groups.

A one-token decoding step reads every weight once, so its time is set by the bytes of weights read. Keeping the
weights quantized reads 1 byte (int8) or about 0.6 byte (int4, group 32) per weight instead of 4 (float32).
The matmuls run on torch's weight-only kernels, the ones gpt-fast and torchao call on CPU:
  int8: aten._weight_int8pack_mm(x, codes (N, K) int8, scales (N,))           y = (x @ codes.T) * scales
  int4: quantized.int4mm_packed_weight_cpu(x, packed, group, scale_zeros)  w = (code - 8) * scale + zero
Facts measured with torch 2.13 on an AVX2 CPU (scripts/bench/quant.py prints them again):
- Both kernels are vectorized for bfloat16 activations only (on x86); float32 activations take a scalar loop
  5-30x slower than a dense float32 matmul. So these layers compute in bfloat16 (the input is rounded to bfloat16,
  the output comes back in the input's dtype), with the scales and zero points stored in bfloat16 too.
- Both kernels compute every output row on its own, accumulating over K in a fixed order whatever the number of
  rows: a row's result is bitwise the same in a one-row call and inside a wide one. So one kernel per layer keeps
  decoding batch-invariant (a token's logits do not depend on the step shape that computed them).
- From about 16-32 rows on a dense float32 matmul is faster; `dense_from_rows` switches to a dequantized float32
  copy there, which costs 4 bytes a weight more and breaks batch invariance (the two kernels round differently),
  so it is off by default.
The embedding is only looked up, never multiplied, so it needs no kernel: QuantizedEmbedding keeps int8 codes with
a scale per 32 values (GGUF's Q8_0, taken code for code from such a file) and dequantizes the rows a step looks
up. A 7B model's embedding then takes 0.15 GB instead of 0.52 GB in float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .integer_linear import W7A8Linear, w7a8_missing

MODES = ("int8", "int4", "w7a8")  # w7a8: integer matmuls, integer_linear.py
GROUP_SIZES = (32, 64, 128, 256)  # the only groups _weight_int4pack_mm_for_cpu accepts
KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # float32: exact scales, but the kernels' slow scalar path
INT4_OFFSET = 8  # the kernel reads a 4-bit code c in [0, 15] as the signed value c - 8
INT4_ROWS = 16  # _convert_weight_to_int4pack_for_cpu packs output rows in blocks of 16
# Rows packed per call: the packing reads int32 codes, 4 bytes a weight, so a whole matrix at once (a 7B model's
# output head: 0.5 GB) would dominate peak memory while loading. Row blocks that are multiples of 64 pack
# independently (measured: concatenated blocks equal the whole matrix packed, bit for bit; on an AVX2 CPU multiples
# of 32 do too, on an AVX-512 one blocks of 32, 48 or 96 do not), and tests/test_quant.py checks it.
PACK_ROWS = 1024


@dataclass(frozen=True)
class Int8Weight:
    """A weight (N, K) as int8 codes with one scale per output channel: w[n, k] = codes[n, k] * scales[n]."""

    codes: torch.Tensor  # (N, K) int8 in [-127, 127]
    scales: torch.Tensor  # (N,) float32

    @classmethod
    def from_float(cls, weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> "Int8Weight":
        """Symmetric round-to-nearest; the scale is rounded to scale_dtype first, so the codes fit the scale the
        kernel will use."""
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype).float()
        codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes, scales)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        return self.codes.float() * self.scales[:, None]


@dataclass(frozen=True)
class Int4Weight:
    """A weight (N, K) as 4-bit codes in groups of `group_size` along K, each group with a scale and a zero point:
    w[n, k] = (codes[n, k] - 8) * scales[n, g] + zeros[n, g], g = k // group_size (torch's int4 convention)."""

    codes: torch.Tensor  # (N, K) uint8 in [0, 15], one code a byte (packed only inside QuantizedLinear)
    scales: torch.Tensor  # (N, K // group_size) float32
    zeros: torch.Tensor  # (N, K // group_size) float32

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = 32,
                   scale_dtype: torch.dtype = torch.bfloat16) -> "Int4Weight":
        """Asymmetric round-to-nearest per group: the group's range [min, max] in 15 steps. Scale and zero point
        are rounded to scale_dtype first and the codes chosen for the rounded values."""
        N, K = weight.shape
        w = weight.detach().float().reshape(N, K // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype).float()
        zeros = (low + INT4_OFFSET * scales).to(scale_dtype).float()
        codes = torch.round((w - zeros[..., None]) / scales[..., None]).add_(INT4_OFFSET).clamp_(0, 15)
        return cls(codes.to(torch.uint8).reshape(N, K), scales, zeros)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, rounded once from the exact (code - 8) * scale + zero, as the kernels' fused
        multiply-add rounds (computed in float64, where that sum is exact)."""
        N, K = self.codes.shape
        scales, zeros = self.scales[..., None], self.zeros[..., None]
        if _products_exact(self.scales) and bool(zeros.isfinite().all()):
            # (code - 8) * scale is then exact in float32 too, so float32's one rounding of the sum is float64's
            # (the float64 sum is exact unless one term is below half an ulp of the other): 4x faster, same bits.
            signed = self.codes.reshape(N, -1, self.group_size).float().sub_(INT4_OFFSET)
            return signed.mul_(scales).add_(zeros).reshape(N, K)
        signed = (self.codes.double() - INT4_OFFSET).reshape(N, -1, self.group_size)
        return (signed * scales.double() + zeros.double()).reshape(N, K).float()


def _products_exact(scales: torch.Tensor) -> bool:
    """Whether scale * (code - 8) is exact in float32 for every scale and code: at most 21 significant bits (the
    3 lowest stored bits zero; a signed code needs 4) and no overflow at 8 x scale."""
    low_bits_zero = ((scales.view(torch.int32) & 7) == 0).all()
    return bool(low_bits_zero and (scales * 8).isfinite().all())


@dataclass(frozen=True)
class Int8GroupWeight:
    """A weight (N, K) as int8 codes with one scale per group of `group_size` along K:
    w[n, k] = codes[n, k] * scales[n, k // group_size]. GGUF's Q8_0 is exactly this with groups of 32 and float16
    scales (kept here in float32, where a float16 scale times an 8-bit code is exact). No torch kernel multiplies
    by it; QuantizedEmbedding looks rows up in it."""

    codes: torch.Tensor  # (N, K) int8 in [-127, 127]
    scales: torch.Tensor  # (N, K // group_size) float32

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = 32) -> "Int8GroupWeight":
        """Symmetric round-to-nearest per group, as llama.cpp's Q8_0 quantizes (scale = largest magnitude / 127),
        with the scale rounded to float16 first and the codes chosen for the rounded scale."""
        N, K = weight.shape
        if K % group_size:
            raise ValueError(f"int8 groups need a width divisible by group_size; got {K} and {group_size}")
        w = weight.detach().float().reshape(N, K // group_size, group_size)
        tiny = torch.finfo(torch.float16).tiny
        scales = (w.abs().amax(dim=-1) / 127).clamp_min(tiny).to(torch.float16).float()
        codes = torch.round(w / scales[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes.reshape(N, K), scales)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight's rows at `index` (any shape of int64), dequantized: index.shape + (K,) float32."""
        flat = index.reshape(-1)  # index_select: a third cheaper than indexing for a decoding step's few rows
        codes, scales = self.codes.index_select(0, flat), self.scales.index_select(0, flat)
        K = self.codes.shape[1]
        grouped = codes.view(flat.numel(), K // self.group_size, self.group_size).float() * scales.unsqueeze(-1)
        return grouped.view(*index.shape, K)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        return self.rows(torch.arange(self.codes.shape[0]))


QuantizedWeight = Union[Int8Weight, Int4Weight]


def map_rows(weight: QuantizedWeight, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
    """Apply a function over the output dimension (dim 0) to every tensor of the weight, e.g. a row permutation."""
    return dataclasses.replace(weight, **{f.name: fn(getattr(weight, f.name)) for f in dataclasses.fields(weight)})


def cat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Weights stacked along the output dimension (as fused projections are); all of one kind and group."""
    first = parts[0]
    return dataclasses.replace(first, **{f.name: torch.cat([getattr(p, f.name) for p in parts])
                                         for f in dataclasses.fields(first)})


def quantize_weight(weight: torch.Tensor, mode: str, group_size: int,
                    scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    check_options(mode, group_size)
    if mode == "int8":
        return Int8Weight.from_float(weight, scale_dtype)
    if weight.shape[1] % group_size:
        raise ValueError(f"int4 needs in_features divisible by group_size; got {weight.shape[1]} and {group_size}")
    if weight.shape[0] % INT4_ROWS:
        raise ValueError(f"int4 needs out_features divisible by {INT4_ROWS} (the kernel's packing); got "
                         f"{weight.shape[0]}")
    return Int4Weight.from_float(weight, group_size, scale_dtype)


def check_options(mode: str, group_size: int) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose from {', '.join(MODES)}")
    if mode == "w7a8" and w7a8_missing():
        raise ValueError(f"w7a8 cannot run here: {w7a8_missing()}; choose int8 or int4")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}; got {group_size!r}")


class QuantizedLinear(nn.Module):
    """A linear layer y = x @ W.T + b with W kept quantized in the kernel's layout.

    x: (..., K) in any float dtype; it is rounded to kernel_dtype for the kernel, and y: (..., N) comes back in
    x's dtype. Each row's result depends only on that row (see the module docstring), unless dense_from_rows is
    set: calls with at least that many rows then use a dequantized float32 copy (kept, 4 bytes a weight), which
    is faster for wide steps but rounds differently from the quantized kernel.
    """

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                 kernel_dtype: torch.dtype = torch.bfloat16, dense_from_rows: int | None = None) -> None:
        super().__init__()
        if kernel_dtype not in KERNEL_DTYPES:
            raise ValueError(f"kernel_dtype must be bfloat16 or float32; got {kernel_dtype}")
        self.out_features, self.in_features = weight.codes.shape
        self.mode = "int8" if isinstance(weight, Int8Weight) else "int4"
        if isinstance(weight, Int8Weight):
            self.register_buffer("codes", weight.codes.contiguous())
            self.register_buffer("scales", weight.scales.to(kernel_dtype))
        else:
            self.group_size = weight.group_size
            self.register_buffer("group_size_tensor", torch.tensor(weight.group_size), persistent=False)
            self.register_buffer("packed", pack_int4(weight.codes))
            scale_zeros = torch.stack([weight.scales, weight.zeros], dim=-1).transpose(0, 1)  # (K / group, N, 2)
            self.register_buffer("scale_zeros", scale_zeros.contiguous().to(kernel_dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.dense_from_rows = dense_from_rows
        self.register_buffer("dense", None if dense_from_rows is None else self.kernel_weight(weight))

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The activations' dtype inside the kernel: that of the stored scales."""
        return (self.scales if self.mode == "int8" else self.scale_zeros).dtype

    @property
    def quantized_as(self) -> str:
        """How this layer computes, in a few words ("int4 g32 bfloat16"): part of the keys under which step costs
        and batch-invariance verdicts are kept (step_costs.cost_key reads it from every layer that has it)."""
        group = f" g{self.group_size}" if self.mode == "int4" else ""
        dense = f" dense from {self.dense_from_rows} rows" if self.dense_from_rows is not None else ""
        return f"{self.mode}{group} {str(self.kernel_dtype).removeprefix('torch.')}{dense}"

    def _apply(self, fn: Callable, recurse: bool = True) -> "QuantizedLinear":
        """model.to(device) moves the scales, but model.to(dtype) must not change their dtype: float32 scales
        would send the kernels down their scalar path."""
        dtype = self.kernel_dtype
        super()._apply(fn, recurse)
        name = "scales" if self.mode == "int8" else "scale_zeros"
        setattr(self, name, getattr(self, name).to(dtype))
        return self

    def kernel_weight(self, weight: QuantizedWeight) -> torch.Tensor:
        """(N, K) float32: the weight the kernel multiplies by, i.e. with scales as stored in kernel_dtype."""
        return map_scales(weight, lambda s: s.to(self.kernel_dtype).float()).dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.dense is not None and rows.shape[0] >= self.dense_from_rows:
            y = F.linear(rows.to(self.dense.dtype), self.dense).to(x.dtype)
        else:
            y = self.kernel(rows.to(self.kernel_dtype, memory_format=torch.contiguous_format)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: (M, K) in kernel_dtype -> (M, N) in kernel_dtype."""
        if self.mode == "int8":
            return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
        # The kernel that takes the group size as a tensor: in a compiled layer that every layer calls
        # (compiled.layer_region), aten._weight_int4pack_mm_for_cpu's lowering makes it a constant the subgraph
        # does not receive. The same kernel underneath, the same bits.
        return torch.ops.quantized.int4mm_packed_weight_cpu(rows, self.packed, self.group_size_tensor,
                                                            self.scale_zeros)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{group}, "
                f"kernel_dtype={self.kernel_dtype}, dense_from_rows={self.dense_from_rows}")


class QuantizedEmbedding(nn.Module):
    """A token embedding kept as int8 codes in groups (Int8GroupWeight): about 1.1 bytes a weight instead of 4, so a
    7B model's embedding takes 0.15 GB instead of 0.52. A lookup dequantizes only the rows it returns.

    tokens: (...) int64 -> (..., K) float32, every value exactly codes * scale (Transformer.forward converts it to
    the model's dtype). A GGUF file's Q8_0 embedding is taken code for code, so its rows equal the float path's."""

    def __init__(self, weight: Int8GroupWeight) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.codes.shape
        self.group_size = weight.group_size
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())

    def _apply(self, fn: Callable, recurse: bool = True) -> "QuantizedEmbedding":
        """model.to(device) moves the scales; model.to(dtype) must not round them."""
        super()._apply(fn, recurse)
        self.scales = self.scales.float()
        return self

    @property
    def quantized_as(self) -> str:
        """How this embedding is stored, in a few words (see QuantizedLinear.quantized_as)."""
        return f"embedding int8 g{self.group_size}"

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return Int8GroupWeight(self.codes, self.scales).rows(tokens)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8, group_size={self.group_size}"


def quantize_embedding(model: nn.Module, weight: Int8GroupWeight | None = None, group_size: int = 32) -> nn.Module:
    """Replace the model's float token embedding (`tok_embeddings`) by a QuantizedEmbedding, in place; returns the
    model. weight: the codes to take as they are (a GGUF file's Q8_0 rows), else the float embedding is quantized.
    A head tied to the embedding keeps the float matrix alive unless it was quantized first (quantize_linears)."""
    embedding = model.tok_embeddings
    if weight is None:
        weight = Int8GroupWeight.from_float(embedding.weight, group_size)
    elif tuple(weight.codes.shape) != tuple(embedding.weight.shape):
        raise ValueError(f"tok_embeddings: given weight has shape {tuple(weight.codes.shape)}, "
                         f"the embedding {tuple(embedding.weight.shape)}")
    model.tok_embeddings = QuantizedEmbedding(weight).to(embedding.weight.device)
    return model


def pack_int4(codes: torch.Tensor, rows: int = PACK_ROWS) -> torch.Tensor:
    """codes (N, K) uint8 in [0, 15] -> (N, K / 2) uint8 in the CPU kernel's layout, `rows` rows (a multiple of 64)
    at a time, so that only one block's int32 copy exists at once."""
    if rows % 64:
        raise ValueError(f"int4 codes are packed in blocks of a multiple of 64 rows, got {rows}")
    return torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(block.int(), 1)
                      for block in codes.split(rows)])


def map_scales(weight: QuantizedWeight, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
    """The weight with fn applied to its floating tensors (scales and zero points), codes unchanged."""
    return dataclasses.replace(weight, **{f.name: fn(getattr(weight, f.name)) for f in dataclasses.fields(weight)
                                          if f.name != "codes"})


def linear_modules(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """(qualified name, parent, attribute, module) of every float linear layer: nn.Linear, or any module with a
    2-D floating `weight` whose class name ends in "Linear" (the prepacked and row-tiled variants in device.py)."""
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            weight = getattr(child, "weight", None)
            linear = isinstance(child, nn.Linear) or type(child).__name__.endswith("Linear")
            if linear and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point():
                found.append((f"{parent_name}.{attr}" if parent_name else attr, parent, attr, child))
    return found


def quantize_linears(model: nn.Module, mode: str = "int4", group_size: int = 32, *,
                     weights: Mapping[str, QuantizedWeight] | None = None, kernel_dtype: torch.dtype = torch.bfloat16,
                     dense_from_rows: int | None = None) -> nn.Module:
    """Replace every float linear layer of a CPU model by a QuantizedLinear (a W7A8Linear for mode "w7a8"), in
    place; returns the model.

    weights: already-quantized weights by module name (e.g. "layers.0.attention.wqkv", from GGUF blocks, see
    checkpoints/gguf_quant.py), used instead of quantizing that layer's float weight (w7a8 rounds their
    dequantized values to its own codes, so a GGUF file's layers need not be read as floats). Raises ValueError for an
    unknown mode or group size, a non-CPU model, or an int4 layer whose in_features the group does not divide.
    """
    check_options(mode, group_size)
    weights = dict(weights or {})
    linears = linear_modules(model)
    for name, _, _, child in linears:  # every layer checked and quantized before any is swapped
        device = child.weight.device.type  # "meta" for a layer whose weight was never loaded: it must be given
        if device != "cpu" and not (device == "meta" and name in weights):
            raise ValueError(f"quantized layers run on the CPU only; {name} is on {child.weight.device}")
        if name in weights and tuple(weights[name].codes.shape) != tuple(child.weight.shape):
            raise ValueError(f"{name}: given weight has shape {tuple(weights[name].codes.shape)}, "
                             f"the layer {tuple(child.weight.shape)}")
        if name not in weights and mode != "w7a8":
            try:
                weights[name] = quantize_weight(child.weight, mode, group_size, kernel_dtype)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    if mode == "w7a8":  # each layer's floats made, rounded to its codes and let go in turn
        for name, parent, attr, child in linears:
            setattr(parent, attr, W7A8Linear(weights[name].dequantize() if name in weights else child.weight,
                                             child.bias))
        return model
    for name, parent, attr, child in linears:
        setattr(parent, attr, QuantizedLinear(weights[name], child.bias, kernel_dtype=kernel_dtype,
                                              dense_from_rows=dense_from_rows))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights share one), and of
    the weights w7a8 layers keep packed outside them."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    packed = sum(m.weight_bytes() for m in model.modules() if isinstance(m, W7A8Linear))
    return sum(storages.values()) + packed
