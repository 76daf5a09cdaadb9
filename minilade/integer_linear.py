"""Linear layers whose matmul is integer arithmetic ("w7a8"): weights as 7-bit codes with a scale per output
channel, each input row rounded to 8-bit codes with a scale of its own, multiplied on fbgemm's u8 x s8 kernel,
the one PyTorch ships for x86 CPUs (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`).

For a row x (K,) and an output channel n:

    s_x = max|x| / 127              q_x = round(x / s_x)       integers in [-127, 127]
    s_w[n] = max|w[n]| / 63         q_w[n] = round(w[n] / s_w[n])   integers in [-63, 63]
    y[n] = (float(sum_k q_x[k] * q_w[n, k]) * s_w[n]) * s_x

Why this shape of quantization:
- The sum is over integers and exact in any order, so a row's result cannot depend on which other rows share the
  call, nor on how the kernel blocks them: the layer is batch-invariant by construction, the property lookahead's
  exactness rests on (device.make_exact still checks the whole model at load). Each row's scale comes from that
  row alone (a maximum, exact in any order).
- Extra rows are cheap. The kernel multiplies 32 byte pairs per instruction: over all of the demo model's layers
  (AVX2, 2 threads) 8 rows cost 1.2x one row in it, 32 rows 3.7x, where torch's int4 kernel (quant.py) costs
  2.4x and 9.7x, at the same one-row time (scripts/bench/quant.py --parts layers compares them layer by layer).
  Wide steps (lookahead's drafts, a server's batched requests) are what this buys. Rounding each row's
  activations costs a few small operations a layer, about 6 ms a one-row step of the demo model.
- Weights get 7 bits, not 8: without AVX512-VNNI the kernel adds pairs of u8 x s8 products in 16 bits with
  saturation, which 8-bit activations (stored as u8 with zero point 128: at most 255) times 8-bit weights overflow
  (2 x 255 x 127 > 32767) and 7-bit weights do not (2 x 255 x 64 = 32640). 8-bit activations with 7-bit weights
  measured closer to the float model than the other way round (docs/benchmarks.md: perplexity).
- The sum stays exact in float32 up to K = 2^24 / (128 x 64) = 2048 inputs; a longer row rounds it once, the same
  way at every row count.
Memory: one byte a weight (the int4 layers of quant.py take about 0.6). The codes, and fbgemm's packing of them
(its own object, not a tensor), are not in the module's state_dict.
"""

from __future__ import annotations

import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from . import native

WEIGHT_LEVELS = 63       # weight codes in [-63, 63]
ACTIVATION_LEVELS = 127  # activation codes in [-127, 127], handed to the kernel as u8 with zero point 128
ZERO_POINT = 128
_KERNEL = "linear_with_input_q_dq_qweight_dq_output_fp32"
TINY = torch.finfo(torch.float32).tiny
PACKERS = 2  # threads packing layers' codes for fbgemm at once (pack_layers)
ROUNDING_BLOCK = 1 << 21  # weights rounded to codes at a time (w7a8_codes)


def w7a8_missing() -> str | None:
    """Why w7a8 layers cannot run here (no fbgemm kernel in this PyTorch build), or None."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no fbgemm (x86) quantized engine"
    if not hasattr(torch.ops.quantized, _KERNEL):
        return f"this PyTorch build has no quantized::{_KERNEL} kernel"
    return None


def w7a8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> codes (N, K) int8 in [-63, 63] and scales (N,) float32: symmetric round-to-nearest
    per output channel. Rounded ROUNDING_BLOCK values at a time through one float32 buffer: a whole weight's
    temporaries (an output head's are 100 MB) cost more in fresh pages than the arithmetic (5x, measured)."""
    w = weight.detach()
    # max |w| per row with no |w| copy of the weight (rounding to float32 is monotonic: the same maximum either side)
    largest = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg()).float()
    scales = (largest / WEIGHT_LEVELS).clamp_min(TINY)
    codes = torch.empty(w.shape, dtype=torch.int8)
    rows = max(1, ROUNDING_BLOCK // max(1, w.shape[1]))
    buffer = torch.empty(min(rows, w.shape[0]), w.shape[1])
    for a in range(0, w.shape[0], rows):
        part = w[a:a + rows].float()
        rounded = torch.div(part, scales[a:a + rows, None], out=buffer[:part.shape[0]]).round_()
        codes[a:a + rows] = rounded.clamp_(-WEIGHT_LEVELS, WEIGHT_LEVELS)
    return codes, scales


def pack_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    """w7a8_codes' codes (N, K) and scales (N,) packed for fbgemm's kernel: on one core, with the GIL released (about
    5 ns a weight), so several threads can pack at once (pack_layers)."""
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user-facing type, not the kernel
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(codes, scales.double(),
                                                           torch.zeros_like(scales, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qweight, None)


def pack_layers(model: nn.Module) -> None:
    """Pack the codes of every w7a8 layer of the model that has not packed them yet (W7A8Linear.packed), on PACKERS
    threads (fewer if torch has fewer threads), largest first so that packing does not end on one thread with a big
    output head alone: 0.7 s of packing on one core for the demo model. Before a model runs its layers through
    fbgemm (eager or compiled steps); native steps never need it."""
    layers = sorted((m for m in model.modules() if isinstance(m, W7A8Linear) and m.unpacked),
                    key=lambda m: -m.weight_bytes())
    with ThreadPoolExecutor(max(1, min(PACKERS, torch.get_num_threads())), thread_name_prefix="w7a8") as pool:
        packed = list(pool.map(lambda layer: pack_weight(*layer.weight_codes()), layers))
    for layer, packing in zip(layers, packed):
        layer.take_packing(packing)


# fbgemm's packed weight is an object a compiled graph cannot hold. Inside one, a layer's matmul is the operator
# minilade::w7a8_matmul, handed the layer's weight scales (a tensor: the graph lifts it as an input, so layers of one
# shape share a graph), by whose storage it finds the layer here. Registered on the dispatcher directly: through
# torch's custom_op decorator a compiled one-row step of the demo model took 26.8 ms, against 23.8 (measured). Its
# body is Python below, or C++ where load_native_matmul could build it (csrc/w7a8_matmul.cpp).
_LAYERS: weakref.WeakValueDictionary[int, W7A8Linear] = weakref.WeakValueDictionary()
_LIBRARY = torch.library.Library("minilade", "DEF")
_LIBRARY.define("w7a8_matmul(Tensor codes, Tensor weight_scales) -> Tensor")
NATIVE_SOURCE = Path(__file__).parent / "csrc" / "w7a8_matmul.cpp"


def w7a8_matmul(codes: torch.Tensor, weight_scales: torch.Tensor) -> torch.Tensor:
    """codes (..., K) float32 holding integers in [-127, 127] -> (..., N) float32: each output channel's sum of integer
    products times its weight scale, by the layer whose weight_scales buffer this is (W7A8Linear's kernel call)."""
    layer = _LAYERS[weight_scales.data_ptr()]
    return layer.kernel(codes, 1.0, ZERO_POINT, layer.packed)


def python_body() -> torch.library.Library:
    """Register w7a8_matmul as the operator's CPU body; the Library it returns holds the registration."""
    body = torch.library.Library("minilade", "IMPL")
    body.impl("w7a8_matmul", w7a8_matmul, "CPU")
    return body


_BODY: torch.library.Library | None = python_body()  # None once the C++ body replaced it
# Each layer's forgetting by the C++ body, run when the layer goes or hands its codes over (W7A8Linear.hand_over):
# kept here, not on the module, so that copies of a module (deepcopy, pickle) do not carry it.
_FORGET: weakref.WeakKeyDictionary[nn.Module, weakref.finalize] = weakref.WeakKeyDictionary()


def load_native_matmul() -> str | None:
    """Give minilade::w7a8_matmul its C++ body (NATIVE_SOURCE) in place of the Python one: the same fbgemm call, so
    the same bits, without a Python call in each of a compiled step's matmuls (1.2 ms of a 9.6 ms compiled one-row
    step of the demo model, docs/benchmarks.md). Built once a machine and torch version (native.build; rebuilt when
    the source changes; a few seconds). Returns None when the C++ body runs, else why the Python body stays."""
    global _BODY
    if _BODY is None:
        return None
    _BODY._destroy()  # before the C++ body registers, or the dispatcher warns of an overridden kernel
    missing = native.build("w7a8_matmul", NATIVE_SOURCE, ["-O2"], what="w7a8")
    if missing:
        _BODY = python_body()
        return missing
    _BODY = None
    for layer in list(_LAYERS.values()):
        layer._register()
    return None


@torch.library.register_fake("minilade::w7a8_matmul", lib=_LIBRARY)
def _(codes: torch.Tensor, weight_scales: torch.Tensor) -> torch.Tensor:
    return codes.new_empty(*codes.shape[:-1], weight_scales.shape[0])


class W7A8Linear(nn.Module):
    """y = x @ W.T + b with W in 7-bit codes and each row of x rounded to 8-bit codes (see the module docstring).

    x: (..., K) in any float dtype, computed in float32; y: (..., N) in x's dtype. A row's result depends only on
    that row.

    The layer holds its codes (N, K) int8 until it first runs through fbgemm, which packs them (`packed`, or
    pack_layers for a whole model on several threads) and keeps only its packing: native steps lay the codes out
    themselves (native_steps.register_layers), so a model they run never packs for fbgemm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight: (N, K) float, rounded to codes here (w7a8_codes)."""
        super().__init__()
        missing = w7a8_missing()
        if missing:
            raise ValueError(f"w7a8 layers need fbgemm: {missing}")
        # The codes and scales until packed. The scales stay float32 here whatever .to() makes of the buffer below.
        self._codes: tuple[torch.Tensor, torch.Tensor] | None = w7a8_codes(weight)
        self._packed: torch.ScriptObject | None = None
        codes, scales = self._codes
        self.out_features, self.in_features = codes.shape
        self.kernel = getattr(torch.ops.quantized, _KERNEL).default  # looked up once: it costs microseconds a call
        self.register_buffer("weight_scales", scales, persistent=False)  # (N,): the operator's key and shape
        self._register()
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def unpacked(self) -> bool:
        """Whether the layer holds its codes unpacked (not yet run through fbgemm, nor handed to native steps)."""
        return self._codes is not None

    @property
    def handed_over(self) -> bool:
        """Whether the layer let go of its codes to native steps (hand_over): it holds neither codes nor packing."""
        return self._codes is None and self._packed is None

    @property
    def packed(self) -> torch.ScriptObject:
        """fbgemm's packing of the layer's codes, packed at the first call that needs it."""
        if self._packed is None:
            if self.handed_over:
                raise RuntimeError("this w7a8 layer's codes were handed to native steps (native_steps.take_over): it "
                                   "runs only inside them")
            self.take_packing(pack_weight(*self._codes))
        return self._packed

    def take_packing(self, packed: torch.ScriptObject) -> None:
        """Keep fbgemm's packing of the codes (pack_weight) in their place."""
        self._packed, self._codes = packed, None
        self._register()

    def _register(self) -> None:
        """Be found by w7a8_matmul under the storage of weight_scales (again whenever a copy or a move makes one),
        by its C++ body too once the codes are packed (forgotten there when the layer goes). A copy with fake tensors
        (what a saved graph's guards unpickle, saved_graphs.SavedGraphs) has no storage to key."""
        if isinstance(self.weight_scales, FakeTensor) or self.handed_over:
            return
        address = self.weight_scales.data_ptr()
        _LAYERS[address] = self
        if _BODY is None and self._packed is not None:
            torch.ops.minilade_native.w7a8_register(self.weight_scales, self._packed)
            _FORGET[self] = weakref.finalize(self, torch.ops.minilade_native.w7a8_forget, address, self._packed)
            _FORGET[self].atexit = False

    def hand_over(self) -> None:
        """Let go of the codes, packed or not, once native steps hold a copy of their own (native_steps.take_over):
        the layer then no longer runs by itself (it says so if called)."""
        forget = _FORGET.pop(self, None)
        if forget is not None:
            forget()  # the C++ body's hold on the packed codes, now rather than when the layer goes
        _LAYERS.pop(self.weight_scales.data_ptr(), None)
        self._packed = self._codes = None

    def __setstate__(self, state: dict) -> None:  # copy.deepcopy, pickle
        super().__setstate__(state)
        self._register()

    def _apply(self, fn, recurse: bool = True):  # .to(), .float(): buffers may be replaced
        out = super()._apply(fn, recurse)
        self._register()
        return out

    quantized_as = "w7a8"  # part of the keys under which step costs and exactness verdicts are kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dtype == torch.float32 else x.float()  # (..., K); the kernel takes any leading dims
        # In-place where possible: at one row these few small operations cost as much as the matmul itself.
        scale = rows.abs().amax(dim=-1, keepdim=True).clamp_min_(TINY).div_(ACTIVATION_LEVELS)
        codes = rows.div(scale).round_()  # integers in [-127, 127], which the kernel takes as they are (scale 1)
        if torch.compiler.is_compiling():  # (a graph never reads self.packed: its guards would have to keep it)
            y = torch.ops.minilade.w7a8_matmul(codes, self.weight_scales) * scale
        else:
            y = self.kernel(codes, 1.0, ZERO_POINT, self.packed).mul_(scale)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def weight_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's codes (N, K) int8 and scales (N,) float32 (read back from fbgemm's packing once packed)."""
        if self._codes is not None:
            return self._codes
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float()

    def weight_bytes(self) -> int:
        """Bytes of the codes, packed or not, held outside the module's tensors (the scales are its weight_scales
        buffer)."""
        return self.out_features * self.in_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w7a8"
