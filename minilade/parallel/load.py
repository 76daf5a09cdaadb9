"""Loading one rank's shard: only its part of each tensor is read from the file (plan.py says which part).

safetensors: `get_slice` reads the rows or columns asked for from the memory map. GGUF: rows (output features)
are whole rows of blocks; columns (input features, of wo and w_down) are whole blocks when the cut falls on a
block boundary (it does for Q4_0/Q4_1/Q8_0 whenever the rank's heads or hidden units are a multiple of 32), else
the rows are dequantized a chunk at a time and cut. The embedding is replicated; the head is the rank's rows of
the vocabulary (of the embedding, when tied).
"""

from __future__ import annotations

import hashlib
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterator, Optional

import gguf
import numpy as np
import torch
import torch.distributed as dist
from gguf import GGMLQuantizationType as QType

from ..checkpoints import Checkpoint, CheckpointError, open_checkpoint
from ..checkpoints.gguf import GGUFTensors, to_torch, unpermute_rotary
from ..checkpoints.hf import SafetensorsTensors
from ..checkpoints.hf import _open as open_safetensors
from ..checkpoints.names import TensorSpec, checkpoint_tensors, model_state_dict
from ..model import Transformer
from ..tokenizer import Tokenizer
from .group import DEFAULT_TIMEOUT_S, TensorParallelError, collective, init_tensor_parallel, rank_device, together
from .layers import wrap_rank_model
from .plan import ShardPlan

Cut = Optional[tuple[int, int, int]]  # (axis, start, stop) as ShardPlan.cut gives it; None: the whole tensor
ROWS_AT_ONCE = 256  # rows dequantized together when a cut does not fall on block boundaries
# A part reader: (the tensor's spec, the cut) -> the CPU tensor of that part, in canonical layout.
PartReader = Callable[[TensorSpec, Cut], torch.Tensor]


def load_shard(ckpt: str | Path, *, dtype: torch.dtype, device: torch.device, progress: bool = True,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Transformer, Tokenizer, str]:
    """This rank's model (its Transformer of the shard, see layers.py), the tokenizer and the checkpoint's path,
    with the process group initialised from the environment. Rank 0 opens the checkpoint first (a download
    happens once); any rank's failure, or a checkpoint that differs between ranks, raises TensorParallelError on
    every rank."""
    group = init_tensor_parallel(device, timeout_s)
    device, rank = rank_device(device), dist.get_rank(group)

    def open_files() -> tuple[Checkpoint, Tokenizer]:
        checkpoint = open_checkpoint(ckpt, progress=progress and rank == 0)
        metadata = checkpoint.source.metadata if checkpoint.format == "gguf" else None
        return checkpoint, Tokenizer.from_checkpoint(checkpoint.path, gguf_metadata=metadata)

    opened = together("opening the checkpoint", open_files if rank == 0 else lambda: None, group)
    checkpoint, tokenizer = together("opening the checkpoint", lambda: opened or open_files(), group)
    check_same_checkpoint(checkpoint, group)

    def build() -> Transformer:
        plan = ShardPlan(checkpoint.config, rank, dist.get_world_size(group), tokenizer.vocab_size)
        return build_rank_model(plan, checkpoint_parts(checkpoint, plan), dtype=dtype, device=device, group=group)

    return together("loading the shards", build, group), tokenizer, str(checkpoint.path)


def check_same_checkpoint(checkpoint: Checkpoint, group: dist.ProcessGroup) -> None:
    """Raise TensorParallelError on every rank unless every rank opened the same model: same config, tensor
    shapes and file sizes as rank 0's."""
    mine = fingerprint(checkpoint)
    every: list = [None] * dist.get_world_size(group)
    collective("comparing the checkpoints", lambda: dist.all_gather_object(every, (mine, str(checkpoint.path)), group))
    differ = [rank for rank, (digest, _) in enumerate(every) if digest != every[0][0]]
    if differ:
        raise TensorParallelError(f"rank {differ[0]} opened {every[differ[0]][1]}, which is not the checkpoint rank 0 "
                                  f"opened ({every[0][1]}): config, tensor shapes or file sizes differ")


def fingerprint(checkpoint: Checkpoint) -> str:
    """A digest of what must agree between ranks: the config, every tensor's shape, the weight files' sizes."""
    source = checkpoint.source
    files = [checkpoint.path] if checkpoint.format == "gguf" else sorted({f for f, _ in source.located.values()})
    facts = repr((checkpoint.config, sorted(source.shapes().items()), [f.stat().st_size for f in files]))
    return hashlib.sha256(facts.encode()).hexdigest()


def build_rank_model(plan: ShardPlan, parts: Iterator[tuple[str, torch.Tensor]], *, dtype: torch.dtype,
                     device: torch.device | str, group: dist.ProcessGroup) -> Transformer:
    """The rank's Transformer (plan.rank_config) from its canonical-named parts, made part of the sharded model
    (layers.wrap_rank_model). Built on the meta device, so no weight exists twice."""
    config = plan.rank_config
    with torch.device("meta"):
        model = Transformer(config)
    state = model_state_dict(parts, config, dtype=dtype, device=device)
    head = state.pop("output.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m != "output.weight"]
    if missing or unexpected:
        raise CheckpointError(f"the shard does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if head is None:  # tied: the head is the embedding's rows of this rank's vocabulary (a view)
        start, stop = plan.ranges()["vocab"]
        head = model.tok_embeddings.weight[start:stop]
    model.setup_rope()
    wrap_rank_model(model, head, plan.vocab_chunk, plan.vocab, plan.rank, group)
    return model.eval().requires_grad_(False)


def checkpoint_parts(checkpoint: Checkpoint, plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, this rank's part) for every tensor of the model, in forward order, shapes checked."""
    with ExitStack() as files:
        if checkpoint.format == "gguf":
            read = gguf_part_reader(checkpoint.source, plan)
        else:
            read = safetensors_part_reader(checkpoint.source, files)
        for name, spec in checkpoint_tensors(plan.config).items():
            cut = plan.cut(spec)
            part = read(spec, cut)
            want = list(spec.shape)
            if cut is not None:
                want[cut[0]] = cut[2] - cut[1]
            if tuple(part.shape) != tuple(want):
                raise CheckpointError(f"{checkpoint.path}: part of {name} has shape {tuple(part.shape)}, "
                                      f"expected {tuple(want)}")
            if not torch.isfinite(part).all():
                raise CheckpointError(f"{checkpoint.path}: tensor {name} holds NaN or infinite values")
            yield name, part


def tensor_part(tensor: torch.Tensor | np.ndarray, cut: Cut):
    """The part of an (out, in) or (out,) array along a cut (a view where the array allows)."""
    if cut is None:
        return tensor
    axis, start, stop = cut
    return tensor[start:stop] if axis == 0 else tensor[:, start:stop]


def safetensors_part_reader(source: SafetensorsTensors, files: ExitStack) -> PartReader:
    handles: dict[Path, object] = {}

    def read(spec: TensorSpec, cut: Cut) -> torch.Tensor:
        file = source.located[spec.canonical][0]
        if file not in handles:
            handles[file] = files.enter_context(open_safetensors(file))
        whole = handles[file].get_slice(spec.canonical)
        return whole[:] if cut is None else tensor_part(whole, cut)

    return read


def gguf_part_reader(source: GGUFTensors, plan: ShardPlan) -> PartReader:
    def read(spec: TensorSpec, cut: Cut) -> torch.Tensor:
        tensor = source.by_name[spec.canonical]
        part = to_torch(tensor, source.path) if cut is None else gguf_part(tensor, cut, source.path)
        heads = spec.module.rotary_heads
        if heads is not None:  # the rank's rows are whole heads: un-permute them head by head
            part = unpermute_rotary(part, part.shape[0] // plan.config.head_dim)
        return part

    return read


def gguf_part(tensor: gguf.ReaderTensor, cut: tuple[int, int, int], path: Path) -> torch.Tensor:
    """A part of a GGUF tensor, (out, in) in numpy order, reading only what it needs (see the module doc)."""
    axis, start, stop = cut
    kind, data = tensor.tensor_type, tensor.data
    if axis == 0 or kind in (QType.F32, QType.F16):  # rows, or columns of a plain float array
        return to_torch(tensor._replace(data=tensor_part(data, cut)), path)
    block, size = gguf.GGML_QUANT_SIZES[kind]  # columns per block, bytes per block
    if start % block == 0 and stop % block == 0:
        return to_torch(tensor._replace(data=data[:, start // block * size:stop // block * size]), path)
    chunks = [to_torch(tensor._replace(data=data[i:i + ROWS_AT_ONCE]), path)[:, start:stop]
              for i in range(0, data.shape[0], ROWS_AT_ONCE)]
    return torch.cat(chunks)
