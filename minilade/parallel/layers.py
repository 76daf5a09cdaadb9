"""The two layers that make a rank's ordinary Transformer one part of a sharded model, and what the decoding
code asks of a sharded model.

A rank's model is minilade/model.py's Transformer built from the rank's ModelConfig (plan.py), with
- `wo` and `w_down` wrapped in RankSum: the rank's partial product, summed over ranks in rank order;
- `output` replaced by GatheredHead: the rank's slice of the vocabulary, the logits gathered in rank order.
Both collectives copy rather than reduce in a size-dependent order, so every rank holds the same bits after each
of them: the residual stream, and so the logits every decoder reads, are identical on all ranks. Whatever a
strategy decides from the logits (accepted tokens, a sampled token from the same seeded generator) is therefore
decided identically everywhere. The decisions that do not come from the logits (the seed when none is given,
auto's measured step costs) are rank 0's: the decoding code is given `from_rank0` for the model as its
DecodeContext.agree (llm.py).
"""

from __future__ import annotations

import os
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model import Transformer
from .group import from_leader, gather_last_dim, ordered_sum

T = TypeVar("T")


class LinearPart(nn.Module):
    """A linear layer holding one rank's part of a weight; weight/bias are exposed for code that inspects linear
    layers."""

    def __init__(self, linear: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias


class RankSum(LinearPart):
    """A row-parallel linear layer: `linear` holds this rank's input columns (and the bias on rank 0 only); the
    output is the sum of every rank's product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ordered_sum(self.linear(x), self.group)


class GatheredHead(LinearPart):
    """The output head split over the vocabulary: `linear` holds this rank's rows (at most `chunk`); the logits
    of all ranks are gathered, in rank order, and cut to `vocab` columns: (B, R, dim) -> (B, R, vocab)."""

    def __init__(self, linear: nn.Module, chunk: int, vocab: int, group: dist.ProcessGroup) -> None:
        super().__init__(linear, group)
        self.chunk, self.vocab = chunk, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x)  # (B, R, rows of this rank)
        local = F.pad(local, (0, self.chunk - local.shape[-1]))
        return gather_last_dim(local, self.group)[..., :self.vocab]


def wrap_rank_model(model: Transformer, head: torch.Tensor, chunk: int, vocab: int, rank: int,
                    group: dist.ProcessGroup) -> Transformer:
    """Turn a rank's Transformer into its part of the sharded model: sums after wo and w_down, biases of those
    kept on rank 0 only (added once), and the head of this rank's vocabulary rows `head` (rows, dim)."""
    for block in model.layers:
        for parent, name in ((block.attention, "wo"), (block.feed_forward, "w_down")):
            linear = getattr(parent, name)
            if rank != 0:
                linear.bias = None
            setattr(parent, name, RankSum(linear, group))
    linear = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(head, requires_grad=False)
    model.output = GatheredHead(linear, chunk, vocab, group)
    return model


def process_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group a sharded model runs over (its head knows it), or None for a single-process model."""
    head = getattr(model, "output", None)
    return head.group if isinstance(head, GatheredHead) else None


def is_leader(model: nn.Module) -> bool:
    """True on rank 0 of a sharded model's group, and for a single-process model."""
    group = process_group(model)
    return group is None or dist.get_rank(group) == 0


def from_rank0(model: nn.Module, value: T) -> T:
    """`value` as rank 0 has it, for decisions that do not come from the logits (a sampling seed, a measured step
    cost); the value itself for a single-process model."""
    group = process_group(model)
    return value if group is None else from_leader(value, group)


def read_on_leader(model: nn.Module, read: Callable[[], T]) -> T:
    """read() on rank 0 only (stdin belongs to it); its result, or its ValueError or EOFError, on every rank."""
    group = process_group(model)
    if group is None:
        return read()
    outcome = None
    if dist.get_rank(group) == 0:
        try:
            outcome = ("value", read())
        except ValueError as error:
            outcome = ("ValueError", str(error))
        except EOFError:
            outcome = ("EOFError", "")
    kind, value = from_leader(outcome, group)
    if kind == "ValueError":
        raise ValueError(value)
    if kind == "EOFError":
        raise EOFError
    return value


@contextmanager
def quiet_unless_leader(model: nn.Module) -> Iterator[None]:
    """Output and statistics come from rank 0 only: elsewhere stdout and stderr go nowhere meanwhile (an error
    raised through this block is still printed by the caller, after it)."""
    if is_leader(model):
        yield
        return
    with open(os.devnull, "w") as sink, redirect_stdout(sink), redirect_stderr(sink):
        yield
