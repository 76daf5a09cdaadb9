"""A static, preallocated key/value cache with a committed length, speculative rows, rollback and compaction."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .invariance import KEY_CHUNK, pad_keys_values, round_up, value_columns


class KVCache:
    """Keys and values of every layer in two preallocated buffers.

    k: (n_layers, B, Hkv, slots, D), v: (n_layers, B, Hkv, slots, Dv). Slots [0, length) hold committed tokens.
    A forward pass writes the K/V of its T tokens speculatively at [length, length + T); the caller then decides
    what to keep: `commit(n)` keeps the first n of them in place, `compact(offsets)` moves chosen rows into place
    (an accepted lookahead candidate), and anything past `length` is scratch for the next pass.

    padded: the layout batch-invariant attention reads without copying (invariance.py): slots = capacity rounded
    up to KEY_CHUNK, Dv = value_columns(D), v's column D all ones (it sums the attention weights) and
    the columns after it zero. Otherwise slots = capacity and Dv = D. Slots never written hold zeros, so every
    slot is finite (a hidden key weighs exactly 0).
    """

    def __init__(self, config: ModelConfig, capacity: int, *, batch_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", padded: bool = False) -> None:
        D = config.head_dim
        slots, Dv = (round_up(capacity, KEY_CHUNK), value_columns(D)) if padded else (capacity, D)
        self.k = torch.zeros(config.n_layers, batch_size, config.n_kv_heads, slots, D, dtype=dtype, device=device)
        self.v = torch.zeros(config.n_layers, batch_size, config.n_kv_heads, slots, Dv, dtype=dtype, device=device)
        if padded:
            self.v[..., D] = 1
        self.head_dim = D
        self.capacity = capacity
        self.length = 0

    @property
    def padded(self) -> bool:
        """Whether the cache keeps the padded layout of batch-invariant attention (see the class docstring)."""
        return self.v.shape[-1] != self.head_dim

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise ValueError(
                f"KV cache capacity exceeded: {self.length} committed + {n_new} new tokens > capacity {self.capacity}"
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v: (B, Hkv, T, D) at [length, length + T) and return views of slots [0, length + T),
        (B, Hkv, length + T, D) each, in the cache's dtype."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end, :self.head_dim] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end, :self.head_dim]

    def padded_views(self, layer: int, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (B, Hkv, n_slots, D) and values with their extra columns (B, Hkv, n_slots, value_columns(D)),
        including slots past those written (finite, to be hidden by the caller): views of a padded cache, a padded
        copy of an unpadded one."""
        if self.padded:
            return self.k[layer, :, :, :n_slots], self.v[layer, :, :, :n_slots]
        end = min(n_slots, self.capacity)
        return pad_keys_values(self.k[layer, :, :, :end], self.v[layer, :, :, :end], n_slots)

    def commit(self, n: int) -> None:
        """Keep the first n speculative rows, which are already in place."""
        self.check_room(n)
        self.length += n

    def compact(self, offsets: torch.Tensor) -> None:
        """Keep the speculative rows at length + offsets (ascending, offsets[i] >= i), moved to
        length + 0, 1, ...; the gather copies first, so overlapping moves are safe."""
        n = offsets.numel()
        self.check_room(n)
        src = offsets + self.length
        end = self.length + n
        self.k[:, :, :, self.length:end] = self.k.index_select(3, src)
        self.v[:, :, :, self.length:end] = self.v.index_select(3, src)
        self.length = end

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` committed tokens."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
