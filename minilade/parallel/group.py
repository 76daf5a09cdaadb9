"""The process group of a tensor-parallel run, and the few collectives the sharded model needs.

Every collective here either returns the same bits on every rank or raises on every rank: a rank that fails says
so to the others (`together`), and a rank that never answers ends the others' wait after the group's timeout with
one TensorParallelError line instead of a hang.
"""

from __future__ import annotations

import os
import re
import sys
from datetime import timedelta
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist

from ..errors import TensorParallelError, one_line

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 120.0  # loading a large shard, or one step of a large model on a slow CPU, fits well inside
ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for init_method="env://"


def launched_with_ranks(environ: Mapping[str, str]) -> bool:
    """True when the process was started by torchrun (or alike) as one of several ranks."""
    return all(key in environ for key in ENV_KEYS) and int(environ["WORLD_SIZE"]) > 1


def init_tensor_parallel(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.ProcessGroup:
    """The default process group, initialised from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) unless it already is: NCCL for CUDA devices, gloo for the CPU. A peer that does not join within
    timeout_s raises TensorParallelError."""
    if not dist.is_initialized():
        missing = [key for key in ENV_KEYS if key not in os.environ]
        if missing:
            raise TensorParallelError(f"tensor parallelism needs {', '.join(missing)} in the environment: launch "
                                      f"with torchrun --nproc-per-node K ...")
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as error:  # the store's rendezvous timed out or was refused
            raise TensorParallelError(f"rank {os.environ['RANK']}: the {os.environ['WORLD_SIZE']} ranks did not all "
                                      f"join within {timeout_s:.0f} s: {one_line(error)}") from None
    return dist.group.WORLD


def rank_device(device: torch.device) -> torch.device:
    """A CUDA rank uses the GPU of its local rank (torchrun's LOCAL_RANK); the CPU stays the CPU."""
    if device.type != "cuda":
        return device
    index = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective(what: str, run: Callable[[], T]) -> T:
    """Run a collective; a peer that died or hangs (gloo/NCCL raise after the group's timeout) becomes one line."""
    try:
        return run()
    except RuntimeError as error:
        reason = re.sub(r"^\[[^\]]*\]\s*", "", one_line(error))  # without gloo's source-file prefix
        raise TensorParallelError(f"rank {dist.get_rank()}: {what} failed: a peer rank exited or did not answer "
                                  f"in time ({reason[:160]})") from None


def together(what: str, work: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """Run `work` on every rank, then agree: if it raised (a ValueError or OSError) on any rank, every rank raises
    one TensorParallelError naming the first such rank and its message; else every rank returns its own result."""
    try:
        result, problem = work(), None
    except (ValueError, OSError) as error:
        result, problem = None, one_line(error)
    problems: list[Any] = [None] * dist.get_world_size(group)
    collective(what, lambda: dist.all_gather_object(problems, problem, group=group))
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if failed:
        rank, message = failed[0]
        raise TensorParallelError(f"{what} failed on rank {rank} (of {len(problems)}): {message}")
    return result


def from_leader(value: Any, group: dist.ProcessGroup) -> Any:
    """Rank 0's value (any picklable object), on every rank of the group."""
    box = [value]
    collective("agreeing on rank 0's value",
               lambda: dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group))
    return box[0]


def ordered_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of x, added in rank order on every rank. Unlike all_reduce (whose ring or tree order
    for an element depends on the tensor's size), every element's rounding is then independent of how many rows
    the step has and the same on every rank: lookahead stays exactly plain decoding, and ranks cannot diverge."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    collective("the sum over ranks", lambda: dist.all_gather(parts, x.contiguous(), group=group))
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's x (..., n), the same shape on each, concatenated in rank order: (..., world * n)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    collective("gathering the logits", lambda: dist.all_gather(parts, x.contiguous(), group=group))
    return torch.cat(parts, dim=-1)


def end_run(exit_code: int, finished: bool = False) -> int:
    """The end of a run: exit_code, to return from main. A process in a process group ends here at once instead,
    its output flushed, without leaving the group: leaving tears down connections that a peer may still be reading
    from, and gloo then aborts the process as it leaves or exits ("terminate called without an active exception",
    exit -6 instead of exit_code: seen after failed runs on 1 run in 3, and after finished ones now and then on a
    loaded machine, even past a barrier). finished: every rank got here normally, so they first wait for one
    another, and none ends while another still needs it. After a failure there is no barrier: it could wait for a
    rank that never comes."""
    if dist.is_initialized():
        if finished:
            collective("waiting for the other ranks to finish", dist.barrier)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    return exit_code
