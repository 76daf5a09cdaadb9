"""What LLM.load decides and reads besides the checkpoint's tensors: the device and dtype, where measurements are
kept, a GGUF file's own quantized codes, and the output head's rows that are no tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoints import Checkpoint
from .checkpoints.gguf_quant import INT4_TYPES, gguf_embedding, gguf_int4_weights
from .checkpoints.resolve import kept_tables_dir
from .device import default_device, resolve_dtype
from .model import Transformer
from .quant import linear_modules, map_rows


def gguf_codes(checkpoint: Checkpoint, model: Transformer, n_tokens: int, quantize: str, group_size: int) -> dict:
    """A GGUF file's own codes, by module name, where they map exactly onto the quantized layers asked for: the
    token embedding's Q8_0 rows (any quantize), and for int4 in groups of 32 (and w7a8, which rounds their values
    to its own codes) the linear layers' Q4_0/Q4_1 tensors, the output head's cut to the tokenizer's vocabulary
    as drop_padded_logits cuts the float head. Empty for other formats."""
    if checkpoint.format != "gguf":
        return {}
    blocks: dict = {}
    if quantize in ("int4", "w7a8") and group_size == 32:  # w7a8 rounds the codes' values to its own
        blocks = gguf_int4_weights(checkpoint.source, [name for name, *_ in linear_modules(model)])
        if "output" in blocks:
            blocks["output"] = map_rows(blocks["output"], lambda rows: rows[:n_tokens])
    embedding = gguf_embedding(checkpoint.source)
    if embedding is not None:
        blocks["tok_embeddings"] = embedding
    return blocks


def has_int4_codes(checkpoint: Checkpoint) -> bool:
    """Whether a GGUF file keeps tensors in Q4_0/Q4_1 codes, which int4 layers in groups of 32 take as they are."""
    return checkpoint.format == "gguf" and any(t.tensor_type in INT4_TYPES
                                               for t in checkpoint.source.by_name.values())


def tables_dir(tables: str | Path | bool | None) -> Path | None:
    """The folder `tables` names: True, the command line's (kept_tables_dir); False or None, none. A path to
    something other than a folder is a ValueError (made where it does not exist yet, when first written)."""
    if tables is False or tables is None:
        return None
    folder = kept_tables_dir() if tables is True else Path(tables).expanduser()
    if folder.exists() and not folder.is_dir():
        where = "$MINILADE_TABLES" if tables is True else "tables"
        raise ValueError(f"{where} names {folder}, which is not a folder: measurements are kept in a folder")
    return folder


def device_and_dtype(device: str | torch.device | None, dtype: str | torch.dtype | None
                     ) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a model is loaded in: checked, defaults chosen for the device."""
    device = parse_device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("float16 is supported on CUDA only; use float32 or bfloat16 on the CPU")
    return device, dtype


def parse_device(device: str | torch.device) -> torch.device:
    """A device minilade can run on (cpu, cuda, cuda:N), or a one-line ValueError."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but no CUDA device is available")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) here")
    return parsed


def drop_padded_logits(model: Transformer, n_tokens: int) -> None:
    """Many checkpoints pad the embedding to a round number of rows past the tokenizer's last token. Those rows
    are no tokens at all, so the output head keeps only the first n_tokens rows (a view, no copy): no strategy
    can then choose an id the tokenizer cannot decode, and greedy and sampled outputs stay what they would be
    over the real vocabulary."""
    if n_tokens < model.output.weight.shape[0]:
        model.output.weight = nn.Parameter(model.output.weight[:n_tokens], requires_grad=False)
