"""Hugging Face checkpoint folders: config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. Tensor names are already the canonical ones; nothing is renamed or permuted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig
from ..errors import (
    CheckpointError,
    UnsupportedCheckpointError,
    UnsupportedModelError,
    one_line,
)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def has_safetensors(folder: Path) -> bool:
    """True when the folder holds a single-file or a sharded safetensors checkpoint."""
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


@dataclass(frozen=True)
class SafetensorsTensors:
    """The tensors of a safetensors checkpoint, indexed from the file headers and read lazily."""

    path: Path  # the folder
    located: dict[str, tuple[Path, tuple[int, ...]]]  # name -> (file, shape)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (_, shape) in self.located.items()}

    def stored_name(self, name: str) -> str:
        return name

    def load(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in the stored dtype, one file open at a time, one tensor read at a time."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.located[name][0], []).append(name)
        for file, file_names in by_file.items():
            with _open(file) as handle:
                for name in file_names:
                    yield name, handle.get_tensor(name)


def open_safetensors_folder(folder: Path) -> tuple[ModelConfig, SafetensorsTensors]:
    """Read config.json and the headers of every safetensors file (no tensor data). Raises CheckpointError."""
    config = read_hf_config(folder / CONFIG_FILE)
    located: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _weight_files(folder):
        with _open(file) as handle:
            for name in handle.keys():  # noqa: SIM118 -- a safe_open handle, not a dict
                located[name] = (file, tuple(handle.get_slice(name).get_shape()))
    return config, SafetensorsTensors(path=folder, located=located)


def read_hf_config(path: Path) -> ModelConfig:
    """ModelConfig from a config.json; unsupported models raise UnsupportedCheckpointError naming the file."""
    raw = read_json_object(path)
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "unknown")
        raise UnsupportedCheckpointError(
            f"{path}: quantised Hugging Face checkpoints ({method}) are not supported; use a GGUF file or an "
            f"unquantised checkpoint"
        )
    try:
        return ModelConfig.from_hf_config(raw)
    except UnsupportedModelError as exc:
        raise UnsupportedCheckpointError(f"{path}: {exc}") from exc
    except KeyError as exc:
        raise CheckpointError(f"{path}: missing required key {exc}") from exc


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, else model.safetensors."""
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        return [folder / SINGLE_FILE]
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: no weight_map")
    files = [folder / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{index_path} lists {file.name}, which is missing from {folder}")
    return files


def _open(file: Path) -> Any:
    """safe_open (memory-mapped) with header errors translated; a truncated file fails here, not mid-load."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{file} is not a valid safetensors file (truncated or corrupt): {one_line(exc)}"
        ) from exc


def read_json_object(path: Path, *, optional: bool = False) -> dict[str, Any]:
    """The JSON object in `path`. A missing file is an error, or {} when optional (a checkpoint's side files);
    a file that is not a JSON object is always a CheckpointError naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if optional:
            return {}
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {one_line(exc)}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return value
