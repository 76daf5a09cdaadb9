"""Which part of every tensor one rank holds (Megatron-style tensor parallelism of a LLaMA).

    attention   wq, wk, wv: the rank's heads' rows     wo: the same heads' columns, summed over ranks after
    MLP         gate, up:   the rank's hidden units     down: their columns, summed over ranks after
    head        output:     the rank's slice of the vocabulary, the logits gathered after
    replicated  the embedding, the norms, biases of wo and down (added on rank 0 only)

Query heads, MLP hidden units and the vocabulary are split into equal contiguous ranges. Key/value heads are
split too when the rank count divides them; when it is a multiple of them instead (more ranks than key/value
heads), each key/value head is replicated on the ranks whose query heads use it, as vLLM does. A rank then
runs an ordinary Transformer of its own ModelConfig (n_heads/K, n_kv_heads/K or 1, intermediate_size/K), and
its KV cache holds only its own key/value heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoints.names import TensorSpec
from ..config import ModelConfig
from ..errors import UnsupportedModelError


def valid_rank_counts(config: ModelConfig, most: int = 64) -> list[int]:
    """The rank counts (up to `most`) a model can be split over."""
    return [k for k in range(1, most + 1) if _problem(config, k) is None]


def _problem(config: ModelConfig, ranks: int) -> str | None:
    if config.n_heads % ranks:
        return f"its {config.n_heads} query heads"
    if config.n_kv_heads % ranks and ranks % config.n_kv_heads:
        return f"its {config.n_kv_heads} key/value heads (nor is {ranks} a multiple of them)"
    if config.intermediate_size % ranks:
        return f"its {config.intermediate_size} MLP hidden units"
    return None


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `ranks` holds of a model with `config`; vocab is the head's row count (the
    tokenizer's vocabulary, which may be smaller than the embedding's)."""

    config: ModelConfig
    rank: int
    ranks: int
    vocab: int

    def __post_init__(self) -> None:
        problem = _problem(self.config, self.ranks)
        if problem is not None:
            raise UnsupportedModelError(
                f"cannot split the model over {self.ranks} ranks: {self.ranks} does not divide {problem}; valid rank "
                f"counts: {', '.join(map(str, valid_rank_counts(self.config)))}")

    @property
    def kv_replicated(self) -> bool:
        return self.ranks > self.config.n_kv_heads

    @property
    def rank_config(self) -> ModelConfig:
        """The config of this rank's Transformer: its share of the heads and of the MLP, all else unchanged."""
        c = self.config
        return c.replace(n_heads=c.n_heads // self.ranks, n_kv_heads=max(1, c.n_kv_heads // self.ranks),
                         intermediate_size=c.intermediate_size // self.ranks, head_dim=c.head_dim)

    @property
    def vocab_chunk(self) -> int:
        """Head rows per rank; the last rank's range may be shorter (its logits are padded before gathering)."""
        return -(-self.vocab // self.ranks)

    def ranges(self) -> dict[str, tuple[int, int]]:
        """Named dimension (names.py's) -> this rank's [start, stop) along it."""
        r, c, hd = self.rank_config, self.config, self.config.head_dim
        kv = self.rank // (self.ranks // c.n_kv_heads) if self.kv_replicated else self.rank * r.n_kv_heads
        v0 = min(self.vocab, self.rank * self.vocab_chunk)
        return {
            "q_dim": (self.rank * r.n_heads * hd, (self.rank + 1) * r.n_heads * hd),
            "kv_dim": (kv * hd, (kv + r.n_kv_heads) * hd),
            "ffn": (self.rank * r.intermediate_size, (self.rank + 1) * r.intermediate_size),
            "vocab": (v0, min(self.vocab, v0 + self.vocab_chunk)),
        }

    def cut(self, spec: TensorSpec) -> tuple[int, int, int] | None:
        """(axis, start, stop) of the part of a checkpoint tensor this rank loads, or None for all of it. Only
        the output head is cut along the vocabulary (the embedding is replicated); a bias follows its weight's
        rows."""
        names = spec.module.shape[:len(spec.shape)]  # a bias has only the weight's first (output) dimension
        for axis, name in enumerate(names):
            if name == "vocab" and spec.ours != "output.weight":
                continue
            if name in ("q_dim", "kv_dim", "ffn", "vocab"):
                start, stop = self.ranges()[name]
                return axis, start, stop
        return None
