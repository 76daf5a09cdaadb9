"""Hugging Face checkpoint folders: config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. Tensor names are already the canonical ones; nothing is renamed or permuted.

config.json is read here into a ModelConfig (LLaMA-style model types only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from ..config import ROPE_KINDS, ModelConfig, RopeScaling
from ..config_checks import check_values
from ..errors import (
    CheckpointError,
    UnsupportedCheckpointError,
    UnsupportedModelError,
    one_line,
)
from .families import Family, family_of_model_type

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtypes loaded (converted to the run's dtype); integer and 8-bit float tensors are quantised data.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


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
    """Read config.json and the headers of every safetensors file (no tensor data). Raises CheckpointError for a
    tensor stored twice, UnsupportedCheckpointError for one that is not floating point (integer weights would be
    cast to garbage)."""
    config = read_hf_config(folder / CONFIG_FILE)
    located: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _weight_files(folder):
        with _open(file) as handle:
            for name in handle.keys():  # noqa: SIM118 -- a safe_open handle, not a dict
                if name in located:
                    raise CheckpointError(f"{file}: tensor {name} is also stored in {located[name][0].name}")
                header = handle.get_slice(name)
                if header.get_dtype() not in FLOAT_DTYPES:
                    raise UnsupportedCheckpointError(
                        f"{file}: tensor {name} has dtype {header.get_dtype()}; minilade loads floating-point "
                        f"weights ({', '.join(FLOAT_DTYPES)})")
                located[name] = (file, tuple(header.get_shape()))
    return config, SafetensorsTensors(path=folder, located=located)


# ModelConfig field -> the config.json key it is read from, so that a bad value is reported under its key.
_HF_KEYS = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
    "head_dim": "head_dim", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings", "tie_word_embeddings": "tie_word_embeddings",
    "qkv_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": "mlp_bias", "bos_token_id": "bos_token_id",
    "eos_token_ids": "eos_token_id", "sliding_window": "sliding_window",
}


def read_hf_config(path: Path) -> ModelConfig:
    """ModelConfig from a config.json; unsupported models and values of the wrong type or range raise
    UnsupportedCheckpointError naming the file and the key."""
    raw = read_json_object(path)
    quantization = raw.get("quantization_config")
    if quantization:
        if not isinstance(quantization, dict):
            raise CheckpointError(f"{path}: quantization_config = {quantization!r:.60} is not an object")
        method = quantization.get("quant_method", "unknown")
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
    not LLaMA-style or a value of the wrong type or range (naming its key), KeyError for a missing required key."""
    family = family_of_model_type(cfg.get("model_type"), cfg.get("architectures"))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported activation {act!r:.60}; LLaMA-style models use 'silu'")
    n_heads = cfg["num_attention_heads"]
    values = dict(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        intermediate_size=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim") or 0,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
        sliding_window=_sliding_window(cfg, family),
        **_biases(cfg, family),
    )
    values["rope_theta"], scaling = _rope_from_hf(cfg)
    check_values(values, _HF_KEYS)
    return ModelConfig(rope_scaling=scaling, **values)


def _biases(cfg: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """qkv_bias, o_bias, mlp_bias: the family's own, or LLaMA's attention_bias (all four projections) and
    mlp_bias flags."""
    if family.fixed_biases is not None:
        return dict(family.fixed_biases)
    attention = _flag(cfg, "attention_bias")
    return dict(qkv_bias=attention, o_bias=attention, mlp_bias=_flag(cfg, "mlp_bias"))


def _sliding_window(cfg: Mapping[str, Any], family: Family) -> Any:
    """The attention window every layer uses, 0 for none. Mistral: sliding_window (null: none). Qwen2: only with
    use_sliding_window, and then on the layers from max_window_layers on (or as layer_types says); a window on
    some layers but not others is refused. A window as long as the context never hides a key: 0."""
    window = cfg.get("sliding_window") or 0
    if family.model_type == "qwen2":
        if not cfg.get("use_sliding_window"):
            return 0
        n_layers, first = cfg.get("num_hidden_layers"), cfg.get("max_window_layers", 0)
        kinds = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(n_layers if isinstance(n_layers, int) else 0)]
        if len(set(kinds)) > 1:
            raise UnsupportedModelError(f"a sliding window on some layers only (layer_types {sorted(set(kinds))}) "
                                        f"is not supported; minilade runs one window for every layer")
        window = window if kinds and kinds[0] == "sliding_attention" else 0
    elif family.model_type != "mistral":
        return 0
    context = cfg.get("max_position_embeddings", 2048)
    if isinstance(window, int) and isinstance(context, int) and window >= context:
        return 0
    return window


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[Any, RopeScaling]:
    """Read rope_theta and scaling from either the classic (rope_theta + rope_scaling) or the newer
    rope_parameters form of config.json. Values are checked by ModelConfig and RopeScaling."""
    params, scaling = _object(cfg, "rope_parameters"), _object(cfg, "rope_scaling")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=merged["factor"])
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=merged["factor"],
            low_freq_factor=merged.get("low_freq_factor", 1.0),
            high_freq_factor=merged.get("high_freq_factor", 4.0),
            original_max_position_embeddings=merged.get("original_max_position_embeddings", 8192),
        )
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r:.60}; minilade supports "
                                f"{', '.join(ROPE_KINDS)}")


def _object(cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    """cfg[key] when it is a JSON object, {} when absent or null."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"{key} = {value!r:.60} is not an object")
    return value


def _flag(cfg: Mapping[str, Any], key: str) -> Any:
    """A boolean option, false when absent or null (checked to be a bool by ModelConfig)."""
    value = cfg.get(key)
    return False if value is None else value


def _as_id_tuple(value: Any) -> tuple[Any, ...]:
    """config.json's eos_token_id: absent, one id, or a list of ids (each checked by ModelConfig)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, else model.safetensors. A shard
    name must be a relative path inside the folder (no "..", not absolute): an index must not make minilade
    read files elsewhere. Symbolic links are not resolved, since the hub cache links each file to its blob."""
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        return [folder / SINGLE_FILE]
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: no weight_map")
    files = []
    for name in sorted(set(map(str, weight_map.values()))):
        shard = PurePosixPath(name)
        if shard.is_absolute() or ".." in shard.parts or "\\" in name or not name.endswith(".safetensors"):
            raise CheckpointError(f"{index_path} lists {name!r:.80}, which is not a .safetensors file inside {folder}")
        file = folder / shard
        if not file.is_file():
            raise CheckpointError(f"{index_path} lists {name}, which is missing from {folder}")
        files.append(file)
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
