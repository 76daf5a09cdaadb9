"""The LLaMA transformer: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

No sampling and no file formats here. One forward takes arbitrary tokens with their rotary positions, writes
their keys and values into a KVCache, attends through an optional custom mask, and projects to the vocabulary
only the rows the caller asks for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .invariance import KeyLayout, in_window, invariant_attention, key_layout, step_visibility, work_dtype
from .kv_cache import KVCache


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
                mask: torch.Tensor | None) -> torch.Tensor:
        """mask: what Transformer.attention_mask made of the step mask: a KeyLayout for batch-invariant attention
        (decoding steps on the CPU), else a mask for SDPA ((T, past + T) bool, or None for causal)."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        keys, values = cache.write(layer, k, v)  # (B, Hkv, S, D), S = past + T
        if isinstance(mask, KeyLayout):  # each row's result independent of the step's shape (invariance.py)
            y = invariant_attention(q, *cache.padded_views(layer, mask.keys), mask)
        else:
            y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                               is_causal=mask is None and T > 1,
                                               enable_gqa=self.n_heads != self.n_kv_heads)
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
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, mask)
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
        self.batch_invariant = True
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

    @property
    def invariant_steps(self) -> bool:
        """Decoding steps run batch-invariant attention (invariance.py): on the CPU, where that is verified at
        load, unless `batch_invariant` was switched off (stock kernels, for kernel benchmarks)."""
        return self.batch_invariant and self.device.type == "cpu"

    def setup_rope(self, positions: int = 0) -> None:
        """(Re)build the rotary tables on the weights' device and dtype, covering at least `positions` positions
        and those they covered before; call after moving the model. The tables grow with the caches made
        (new_cache, forward), never to the whole context up front: a header may claim 2^21 positions."""
        have = 0 if self.rope_cos is None else self.rope_cos.shape[0]
        self.rope_cos, self.rope_sin = rope_tables(self.config, rope_rows(self.config, max(have, positions)),
                                                   self.dtype, self.device)

    def new_cache(self, capacity: int | None = None, batch_size: int = 1, invariant: bool | None = None
                  ) -> KVCache:
        """A KV cache of `capacity` slots (default: the whole context); the rotary tables grow to match. For
        batch-invariant decoding steps (invariant=None: when the model runs them, on the CPU) the cache keeps the
        padded layout and attention's work dtype (bfloat16 keys and values stored exactly in float32, read without
        a copy); otherwise plain (L, B, Hkv, capacity, D) buffers in the model's dtype."""
        capacity = capacity or self.config.max_seq_len
        self.cover_positions(capacity)
        invariant = self.invariant_steps if invariant is None else invariant
        return KVCache(self.config, capacity, batch_size=batch_size,
                       dtype=work_dtype(self.dtype) if invariant else self.dtype, device=self.device,
                       padded=invariant)

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
                mask: torch.Tensor | None = None, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run tokens through the model and write their K/V into the cache at [cache.length, cache.length + T).

        tokens: (B, T) token ids. input_pos: (T,) or (B, T) rotary positions; independent of cache slots.
        mask: None for causal attention within the step, or (T, T) bool, True where a row may attend to
            another row of this step. Committed cache rows are always visible. cache.length is not changed:
            the caller commits or compacts afterwards.
        logits_rows: (R,) indices of the rows to project to the vocabulary; None for all T rows.
        Returns logits: (B, R, V) in the model dtype.
        """
        B, T = tokens.shape
        cache.check_room(T)
        if input_pos.dim() == 1:
            input_pos = input_pos.unsqueeze(0)
        self.cover_positions(cache.capacity)
        cos, sin = self.rotary(input_pos)  # (B|1, T, 1, D)
        attn_mask = self.attention_mask(mask, cache.length, T, input_pos)
        x = self.tok_embeddings(tokens).to(self.dtype)  # a quantized embedding returns float32
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, attn_mask)
        if logits_rows is not None:
            x = x[:, logits_rows]
        return self.output(self.norm(x))

    def attention_mask(self, mask: torch.Tensor | None, past: int, T: int, input_pos: torch.Tensor | None = None
                       ) -> KeyLayout | torch.Tensor | None:
        """What attention needs from a step mask (T, T) (None: causal). A decoding step on the CPU gets a KeyLayout,
        so that each row's result is independent of the step's shape. The prefill may use SDPA (lookahead and plain
        decoding read the same prompt K/V), and so does CUDA, where the invariant path is not verified.
        input_pos: (T,) or (B, T) the rows' rotary positions (the same for every sequence of the batch), needed
        with a sliding window: a key more than `sliding_window` positions older than a row is hidden from it.
        Committed cache slot i holds position i."""
        window = self._window(past, T, input_pos)
        if past:
            reach = step_visibility(mask, past, T, self.device)
            visible = reach if window is None else reach & window
            if not self.invariant_steps:
                return visible
            return key_layout(visible, past, self.config.n_heads // self.config.n_kv_heads, self.dtype,
                              counted=None if window is None else reach)
        if mask is not None and mask.shape != (T, T):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({T}, {T}) for {T} tokens")
        if window is None:
            return mask
        causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril_() if mask is None else mask
        return causal & window

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
