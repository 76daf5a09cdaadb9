"""The LLaMA transformer: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

No sampling and no file formats here. One forward takes arbitrary tokens with their rotary positions, writes
their keys and values into a KVCache, attends through an optional custom mask, and projects to the vocabulary
only the rows the caller asks for.

How attention is computed is one object the model holds and every layer calls, `attention_kernel` (by default
`SDPAttention`: torch's scaled_dot_product_attention); it also says which KV cache it reads (`new_cache`). Another
kernel is installed by swapping that object: minilade/invariance.py's batch-invariant one, for exact lookahead.
Likewise `step_runner`, when set, runs every decoding step (a cache already holding rows) in place of the layer
loop, and the prefill too where its `runs_prefill` says so: minilade/compiled.py's compiled graphs (steps only),
minilade/native_steps.py's native layers (every forward, over caches of the `cache_dtype` they name).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache

# A prompt's rows are read in blocks of this many: a block's attention holds scores for its own rows only (the exact
# kernel's invariance.CausalPrefill, and the rest of a prompt after kept rows: decoding.base.Decoder.prefill).
PREFILL_ROWS = 256


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse rotary frequencies (head_dim // 2,), float32, computed as Hugging Face does so that
    positions rotate bit-identically."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s.kind == "linear":
        inv_freq = inv_freq / s.factor
    elif s.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq


def rope_tables(config: ModelConfig, length: int, dtype: torch.dtype, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (length, head_dim) for positions [0, length), in the rotate-half layout (each frequency serves
    both halves). sin is stored with its first half negated, so that rotate_half(x) * sin == roll(x, D/2) *
    sin_signed. A row depends only on its position: any length gives the same rows bit for bit."""
    positions = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config))  # (S, D/2)
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def rope_rows(config: ModelConfig, positions: int) -> int:
    """Rows to build so that `positions` positions are covered: a power of two (at least 64; growth stays rare and
    cos/sin run whole SIMD blocks, so rows are computed as in a table of the full context), capped at the
    model's context, whose last position is the last a rotary table ever needs."""
    return min(config.max_seq_len, max(64, 1 << max(0, positions - 1).bit_length()))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos, sin_signed: (B or 1, T, 1, D). Equals x * cos + rotate_half(x) * sin bit for bit."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def check_mask(mask: torch.Tensor | None, T: int) -> None:
    """A one-line ValueError unless mask is None or (T, T), the shape a step of T tokens takes."""
    if mask is not None and mask.shape != (T, T):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({T}, {T}) for {T} tokens")


def step_visibility(mask: torch.Tensor | None, past: int, T: int, device: torch.device | str) -> torch.Tensor:
    """(T, past + T) bool: every row sees the committed cache, then the step rows its mask (T, T) allows
    (None: causal)."""
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
    return torch.cat([torch.ones(T, past, dtype=torch.bool, device=device), mask.to(device)], dim=1)


def in_window(positions: torch.Tensor, past: int, window: int) -> torch.Tensor:
    """(T, past + T) bool: True where a key lies inside the sliding window of the row at positions (T,), that is
    its position is > row - window. The committed cache holds positions 0..past-1 in order; the step's keys sit at
    the rows' own positions. Causality is step_visibility's business, not this mask's."""
    keys = torch.cat([torch.arange(past, device=positions.device), positions])
    return keys[None, :] > positions[:, None] - window


class SDPAttention:
    """Softmax attention of a step's queries over the cache's written rows: torch's scaled_dot_product_attention.

    The model's attention kernel unless another is installed in its place (Transformer.attention_kernel); a kernel
    has these members. cache_type: the KVCache it reads (Transformer.new_cache makes one). prepare: what every
    layer needs of the step's masks, made once per step. __call__: one layer's attention. A plain object, not a
    module: it holds no weights, and every layer calls it on every step.
    """

    cache_type = KVCache

    def prepare(self, visible: torch.Tensor | None, reach: torch.Tensor | None, past: int, dtype: torch.dtype
                ) -> torch.Tensor | None:
        """SDPA's attn_mask: visible, (T, past + T) bool or None for causal (Transformer.step_masks)."""
        return visible

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                 visible: torch.Tensor | None) -> torch.Tensor:
        """q: (B, H, T, D); k, v: (B, Hkv, T, D), written into the cache at [length, length + T) first.
        Returns (B, H, T, D)."""
        keys, values = cache.write(layer, k, v)  # (B, Hkv, S, D), S = past + T
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=visible,
                                              is_causal=visible is None and q.shape[2] > 1,
                                              enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        qkv_dim = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.o_bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, dim) -> q (B, H, T, D), k and v (B, Hkv, T, D); q and k rotated by cos, sin (B|1, T, 1, D)."""
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        n_qk = self.n_heads + self.n_kv_heads
        qk = apply_rope(qkv[:, :, :n_qk], cos, sin).transpose(1, 2)  # (B, H + Hkv, T, D)
        return qk[:, :self.n_heads], qk[:, self.n_heads:], qkv[:, :, n_qk:].transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                kernel: SDPAttention, step: Any) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T, dim). kernel writes this layer's k, v into the cache and attends; step: what
        kernel.prepare made of the step's mask, once for all layers."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        y = kernel(q, k, v, cache, layer, step)  # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matrix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(config.dim, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.w_down = nn.Linear(config.intermediate_size, config.dim, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as the reference models do. In float32 torch's
        # rms_norm with the weight computes exactly that, in fewer operations.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, eps=self.eps)
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                kernel: SDPAttention, step: Any) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, kernel, step)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.attention_kernel = SDPAttention()  # every layer's attention; swapped to change how it is computed
        # A callable that runs a decoding step in place of the layers below (compiled.py: as compiled graphs).
        self.step_runner = None
        # Buffers (not saved), so that .to(dtype) converts them with the weights.
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype, that of the float weights (read off the final norm: the embedding and
        linear layers may be quantized, quant.py)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def setup_rope(self, positions: int = 0) -> None:
        """(Re)build the rotary tables on the weights' device and dtype, covering at least `positions` positions
        and those they covered before; call after moving the model. The tables grow with the caches made
        (new_cache, forward), never to the whole context up front: a header may claim 2^21 positions."""
        have = 0 if self.rope_cos is None else self.rope_cos.shape[0]
        self.rope_cos, self.rope_sin = rope_tables(self.config, rope_rows(self.config, max(have, positions)),
                                                   self.dtype, self.device)

    @property
    def cache_type(self) -> type[KVCache]:
        """The KV cache its forwards read: the step runner's where it names one (native steps, which run every
        forward), else the attention kernel's."""
        return getattr(self.step_runner, "cache_type", None) or self.attention_kernel.cache_type

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype its KV caches keep keys and values in: the step runner's where it names one (native steps:
        float16), else the activations'."""
        return getattr(self.step_runner, "cache_dtype", None) or self.dtype

    def new_cache(self, capacity: int | None = None, batch_size: int = 1, cache_type: type[KVCache] | None = None
                  ) -> KVCache:
        """A KV cache of `capacity` slots (default: the whole context), of the kind its forwards read
        (cache_type: another kind, for a step that reads the cache its own way), in cache_dtype; the rotary tables
        grow to match."""
        capacity = capacity or self.config.max_seq_len
        self.cover_positions(capacity)
        cache_type = cache_type or self.cache_type
        return cache_type(self.config, capacity, batch_size=batch_size, dtype=self.cache_dtype, device=self.device)

    def cover_positions(self, positions: int) -> None:
        """Grow the rotary tables (when needed) to cover positions [0, positions), up to the model's context."""
        if self.rope_cos is None or self.rope_cos.shape[0] < min(positions, self.config.max_seq_len):
            self.setup_rope(positions)

    def rotary(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for input_pos (B|1, T): (B|1, T, 1, D). A position outside the tables is a ValueError (checked
        where positions live on the host; on an accelerator the lookup itself asserts)."""
        rows = self.rope_cos.shape[0]
        if input_pos.device.type == "cpu" and input_pos.numel():
            low, high = (int(v) for v in torch.aminmax(input_pos))
            if low < 0 or high >= rows:
                where = f"the model's context of {rows} positions" if rows == self.config.max_seq_len else \
                    f"the rotary tables ({rows} positions; model.new_cache(capacity) grows them)"
                raise ValueError(f"rotary position {low if low < 0 else high} is outside {where}")
        return self.rope_cos[input_pos].unsqueeze(2), self.rope_sin[input_pos].unsqueeze(2)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, logits_rows: torch.Tensor | None = None, *,
                prefill: bool = False) -> torch.Tensor:
        """Run tokens through the model and write their K/V into the cache at [cache.length, cache.length + T).

        tokens: (B, T) token ids. input_pos: (T,) or (B, T) rotary positions; independent of cache slots.
        mask: None for causal attention within the step, or (T, T) bool, True where a row may attend to
            another row of this step. Committed cache rows are always visible. cache.length is not changed:
            the caller commits or compacts afterwards.
        logits_rows: (R,) indices of the rows to project to the vocabulary; None for all T rows.
        prefill: the rows are a prompt's (after the part of it already in the cache, if any), computed as a
            prompt's prefill computes them: eagerly, unless the step runner runs prefills too. A forward over an
            empty cache is one anyway.
        Returns logits: (B, R, V) in the model dtype.
        """
        B, T = tokens.shape
        cache.check_room(T)
        if input_pos.dim() == 1:
            input_pos = input_pos.unsqueeze(0)
        self.cover_positions(cache.capacity)
        runner = self.step_runner
        if runner is not None and (runner.runs_prefill or cache.length and not prefill):
            return runner(self, tokens, input_pos, cache, mask, logits_rows)
        cos, sin = self.rotary(input_pos)  # (B|1, T, 1, D)
        past, kernel = cache.length, self.attention_kernel
        visible, reach = self.step_masks(mask, past, T, input_pos)
        step = kernel.prepare(visible, reach, past, self.dtype)  # once per step, for every layer
        x = self.tok_embeddings(tokens).to(self.dtype)  # a quantized embedding returns float32
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, kernel, step)
        if logits_rows is not None:
            x = x[:, logits_rows]
        return self.output(self.norm(x))

    def step_masks(self, mask: torch.Tensor | None, past: int, T: int, input_pos: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What each row of a step may see, from its mask (T, T) (None: causal), as (visible, reach).

        visible: (T, past + T) bool, the keys a row attends to: the committed cache, the step rows its mask allows,
        inside the sliding window; or the step mask itself, (T, T) or None, for a prefill (past 0) that no window
        cuts. reach: the same before the sliding window cuts it, or None where no window is applied (a kernel that
        counts a row's keys in order needs it: invariance.py).
        input_pos: (T,) or (B, T) the rows' rotary positions (the same for every sequence of the batch), needed
        with a sliding window: a key more than `sliding_window` positions older than a row is hidden from it.
        Committed cache slot i holds position i."""
        check_mask(mask, T)
        window = self._window(past, T, input_pos)
        if not past and window is None:
            return mask, None
        reach = step_visibility(mask, past, T, self.device)
        return (reach, None) if window is None else (reach & window, reach)

    def _window(self, past: int, T: int, input_pos: torch.Tensor | None) -> torch.Tensor | None:
        """(T, past + T) bool, True where a key is inside each row's sliding window; None when the model has no
        window or it hides nothing in this step."""
        size = self.config.sliding_window
        if not size:
            return None
        if input_pos is None:
            raise ValueError("a model with a sliding window needs the rows' positions to build its mask")
        if int(input_pos.max()) < size:  # every key is at position >= 0 > row - size
            return None
        positions = input_pos.reshape(-1, T)
        if positions.shape[0] > 1 and not bool((positions == positions[:1]).all()):
            raise ValueError("with a sliding window, every sequence of the batch must use the same positions")
        return in_window(positions[0], past, size)

    def init_random(self, seed: int = 0, std: float = 0.02) -> "Transformer":
        """Random weights (for tests and benchmarks), reproducible from the seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(std * torch.randn(p.shape, generator=gen))
        self.setup_rope()
        return self
