"""Hugging Face checkpoint folders: config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. Tensor names are already the canonical ones; nothing is renamed or permuted.

config.json is read here into a ModelConfig (LLaMA-style model types only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig, RopeScaling
from ..errors import (
    CheckpointError,
    UnsupportedCheckpointError,
    UnsupportedModelError,
    one_line,
)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# model_type values whose checkpoints follow the LLaMA layout exactly (RMSNorm, RoPE, GQA, SwiGLU).
LLAMA_LIKE_MODEL_TYPES = ("llama", "mistral")


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
        return config_from_hf(raw)
    except UnsupportedModelError as exc:
        raise UnsupportedCheckpointError(f"{path}: {exc}") from exc
    except KeyError as exc:
        raise CheckpointError(f"{path}: missing required key {exc}") from exc


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from the dict of a Hugging Face config.json. Raises UnsupportedModelError for a model that is
    not LLaMA-style, KeyError for a missing required key."""
    _check_llama_like(cfg)
    n_heads = cfg["num_attention_heads"]
    theta, scaling = _rope_from_hf(cfg)
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        intermediate_size=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim") or 0,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
    )


def _check_llama_like(cfg: Mapping[str, Any]) -> None:
    """Raise UnsupportedModelError unless the config describes a model the LLaMA code runs exactly."""
    model_type = cfg.get("model_type")
    if model_type not in LLAMA_LIKE_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r} (architectures={cfg.get('architectures')}); "
            f"minilade runs LLaMA-style models: {', '.join(LLAMA_LIKE_MODEL_TYPES)}"
        )
    if cfg.get("sliding_window") not in (None, 0) and model_type == "mistral":
        if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
            raise UnsupportedModelError(f"sliding-window attention ({cfg['sliding_window']}) is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported activation {act!r}; LLaMA-style models use 'silu'")


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """Read rope_theta and scaling from either the classic (rope_theta + rope_scaling) or the newer
    rope_parameters form of config.json."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}; minilade supports linear and llama3")


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    """config.json's eos_token_id: absent, one id, or a list of ids."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


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
