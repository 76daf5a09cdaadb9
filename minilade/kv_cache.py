"""A static, preallocated key/value cache with a committed length, speculative rows, rollback and compaction."""

from __future__ import annotations

import mmap

import torch

from .config import ModelConfig


class KVCache:
    """Keys and values of every layer in two preallocated buffers.

    k, v: (n_layers, B, Hkv, capacity, D). Slots [0, length) hold committed tokens. A forward pass writes the K/V of
    its T tokens speculatively at [length, length + T); the caller then decides what to keep: `commit(n)` keeps the
    first n of them in place, `compact(offsets)` moves chosen rows into place (an accepted lookahead candidate), and
    anything past `length` is scratch for the next pass.
    """

    def __init__(self, config: ModelConfig, capacity: int, *, batch_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.k, self.v = self.allocate(config, capacity, batch_size, dtype, device)
        self.dtype = dtype  # what it was made for; its buffers may hold a wider one (invariance.PaddedKVCache)
        self.head_dim = config.head_dim
        self.capacity = capacity
        self.length = 0

    def allocate(self, config: ModelConfig, capacity: int, batch_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The zeroed k and v buffers, (n_layers, B, Hkv, capacity, D) each, in huge pages where the system gives
        them (every pass reads them: huge_page_zeros)."""
        shape = (config.n_layers, batch_size, config.n_kv_heads, capacity, config.head_dim)
        return huge_page_zeros(shape, dtype, device), huge_page_zeros(shape, dtype, device)

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
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

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


HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 and arm64


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed tensor whose memory the kernel may back with 2 MiB pages; torch.zeros where it cannot (another
    device or system, less than a huge page).

    Every pass reads each layer's keys and values (at 8 served requests of 500 tokens some 90 MB of the demo model's),
    and through 4 KiB pages each page is a translation of its own, as the weights' codes were (native_matmul.h's
    HugePageArena). Linux's transparent huge pages in their default mode back only memory advised for them
    (MADV_HUGEPAGE), and torch's allocator advises none. So the buffer is a private anonymous mapping (zeroed by the
    kernel, unmapped when the last view of it goes), 2 MiB-aligned and advised for huge pages: advice only, 4 KiB
    pages where the kernel gives none.
    """
    n_bytes = torch.Size(shape).numel() * dtype.itemsize
    if torch.device(device).type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE") or n_bytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, n_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # private: a shared one is shmem, no THP
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # its storage holds the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, n_bytes - n_bytes % mmap.PAGESIZE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages
        pass
    return whole[start:start + n_bytes].view(dtype).view(shape)
