"""The two tiny base checkpoints of the checkpoint fuzzer (scripts/fuzz_checkpoints.py) and the mutations made
from them: a GGUF file (gguf's writer, F32 and Q8_0 tensors, a token vocabulary) and a safetensors folder
(config.json + model.safetensors) from random weights; header integers (counts, lengths, types, dimensions,
offsets, metadata values) set to edge values, metadata and config.json values retyped, safetensors header entries
rewritten, bytes flipped, files truncated, a generation_config.json with odd values. Each mutation writes one
mutated checkpoint and returns it with a description of what it changed.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType
from safetensors.numpy import save_file

from minilade.checkpoints import expected_tensor_shapes
from minilade.checkpoints.generation_config import FILE as GENERATION_CONFIG
from minilade.checkpoints.names import gguf_name
from minilade.config import ModelConfig

TINY = ModelConfig(vocab_size=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                   max_seq_len=64)
EDGE_INTEGERS = (0, 1, 2, 3, 5, 31, 32, 255, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 62, 2 ** 63,
                 2 ** 64 - 1)
ODD_VALUES: tuple[Any, ...] = (0, -1, -5, 1, 2 ** 40, 272.0, 1e-40, "64", "", None, True, False, [], [1, 2], {},
                              {"rope_type": "linear", "factor": "x"}, float("inf"), 2 ** 32 - 1)


# ---- the two base checkpoints --------------------------------------------------------------------------------

def tiny_tensors(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Canonical name -> random float32 weights (HF orientation) for every tensor of the config."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in
            expected_tensor_shapes(config).items()}


def gguf_metadata(config: ModelConfig) -> dict[str, tuple[Any, VType]]:
    """llama.cpp's metadata keys for the config, with value types, plus a small token vocabulary."""
    vocab = [f"t{i}" for i in range(config.vocab_size)]
    return {
        "general.architecture": ("llama", VType.STRING),
        "llama.block_count": (config.n_layers, VType.UINT32),
        "llama.context_length": (config.max_seq_len, VType.UINT32),
        "llama.embedding_length": (config.dim, VType.UINT32),
        "llama.feed_forward_length": (config.intermediate_size, VType.UINT32),
        "llama.attention.head_count": (config.n_heads, VType.UINT32),
        "llama.attention.head_count_kv": (config.n_kv_heads, VType.UINT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, VType.FLOAT32),
        "llama.rope.freq_base": (10000.0, VType.FLOAT32),
        "llama.vocab_size": (config.vocab_size, VType.UINT32),
        "tokenizer.ggml.model": ("gpt2", VType.STRING),
        "tokenizer.ggml.tokens": (vocab, VType.ARRAY),
        "tokenizer.ggml.token_type": ([1] * len(vocab), VType.ARRAY),
        "tokenizer.ggml.bos_token_id": (1, VType.UINT32),
        "tokenizer.ggml.eos_token_id": (2, VType.UINT32),
    }


def write_gguf(path: Path, metadata: dict[str, tuple[Any, VType]], tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF file: 2-D weights as Q8_0 (rows of 64 are two blocks), the rest F32; names mapped to GGUF's."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.kv_data[0].clear()  # the writer adds general.architecture itself; here it is one of the values
    for key, (value, kind) in metadata.items():
        writer.add_key_value(key, value, kind)
    for name, array in tensors.items():
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, QType.Q8_0), raw_dtype=QType.Q8_0)
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return {"model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.dim,
            "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.intermediate_size,
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def write_safetensors(folder: Path, config: dict[str, Any], weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / GENERATION_CONFIG).unlink(missing_ok=True)  # only generation_config_value writes one
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(weights)
    return folder


# ---- where a GGUF header's integers are ------------------------------------------------------------------------

def gguf_integer_fields(data: bytes) -> list[tuple[int, str]]:
    """(offset, struct format) of every integer in a well-formed GGUF header: counts, lengths, value and tensor
    types, dimensions, offsets and integer metadata values. Written independently of the reader under test."""
    fields: list[tuple[int, str]] = [(4, "<I"), (8, "<Q"), (16, "<Q")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}

    def string(pos: int) -> int:
        fields.append((pos, "<Q"))
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(pos: int, kind: int) -> int:
        if kind == 8:
            return string(pos)
        if kind == 9:
            item, count = struct.unpack_from("<IQ", data, pos)
            fields.extend([(pos, "<I"), (pos + 4, "<Q")])
            pos += 12
            for _ in range(count):
                pos = value(pos, item)
            return pos
        if scalar[kind] not in ("<f", "<d"):
            fields.append((pos, scalar[kind]))
        return pos + struct.calcsize(scalar[kind])

    for _ in range(n_kv):
        pos = string(pos)
        kind = struct.unpack_from("<I", data, pos)[0]
        fields.append((pos, "<I"))
        pos = value(pos + 4, kind)
    for _ in range(n_tensors):
        pos = string(pos)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields.append((pos, "<I"))
        fields.extend((pos + 4 + 8 * i, "<Q") for i in range(n_dims))
        pos += 4 + 8 * n_dims
        fields.extend([(pos, "<I"), (pos + 4, "<Q")])  # type, offset
        pos += 12
    return fields


# ---- mutations: each returns (description, mutated checkpoint path) --------------------------------------------

@dataclass
class Bases:
    """The unmutated checkpoints, as bytes and values to mutate from."""

    work: Path
    gguf_bytes: bytes
    gguf_fields: list[tuple[int, str]]
    gguf_meta: dict[str, tuple[Any, VType]]
    tensors: dict[str, np.ndarray]
    st_bytes: bytes
    config: dict[str, Any]


def make_bases(work: Path, seed: int = 0) -> Bases:
    tensors = tiny_tensors(TINY, seed)
    meta = gguf_metadata(TINY)
    gguf_bytes = write_gguf(work / "base.gguf", meta, tensors).read_bytes()
    save_file(tensors, str(work / "base.safetensors"))
    return Bases(work, gguf_bytes, gguf_integer_fields(gguf_bytes), meta, tensors,
                 (work / "base.safetensors").read_bytes(), hf_config(TINY))


def _edge(rng: random.Random, original: int) -> int:
    return rng.choice([*EDGE_INTEGERS, original + 1, original - 1, original * 2, rng.getrandbits(64)])


def gguf_integer(b: Bases, rng: random.Random) -> tuple[str, Path]:
    offset, fmt = rng.choice(b.gguf_fields)
    data = bytearray(b.gguf_bytes)
    bits = 8 * struct.calcsize(fmt)
    value = _edge(rng, struct.unpack_from(fmt, data, offset)[0]) % (1 << bits)
    struct.pack_into(fmt.upper(), data, offset, value)
    return _save(b, "m.gguf", data, f"gguf integer at {offset} ({fmt}) := {value}")


def gguf_retype(b: Bases, rng: random.Random) -> tuple[str, Path]:
    meta = dict(b.gguf_meta)
    key = rng.choice(list(meta))
    choice = rng.choice(ODD_VALUES + ("drop", "string"))
    if choice == "drop":
        del meta[key]
    else:
        value = [] if isinstance(choice, dict) else choice
        meta[key] = (str(value) if choice == "string" else value, _value_type(value))
    path = b.work / "r.gguf"
    if path.exists():
        path.unlink()
    try:
        write_gguf(path, meta, b.tensors)
    except (ValueError, TypeError, OverflowError, struct.error):
        return gguf_integer(b, rng)  # the writer cannot express this value; mutate something else
    return f"gguf metadata {key} := {choice!r}", path


def _value_type(value: Any) -> VType:
    if isinstance(value, bool):
        return VType.BOOL
    if isinstance(value, int):
        return VType.INT64 if value < 0 else VType.UINT64
    if isinstance(value, float):
        return VType.FLOAT32
    if isinstance(value, list):
        return VType.ARRAY
    return VType.STRING


def byte_flip(b: Bases, rng: random.Random) -> tuple[str, Path]:
    use_gguf = rng.random() < 0.5
    data = bytearray(b.gguf_bytes if use_gguf else b.st_bytes)
    header = min(len(data), 2048)  # mostly the header, where structure lives
    offset = rng.randrange(header if rng.random() < 0.8 else len(data))
    data[offset] ^= 1 << rng.randrange(8)
    if use_gguf:
        return _save(b, "m.gguf", data, f"gguf byte {offset} flipped")
    return _folder(b, b.config, bytes(data), f"safetensors byte {offset} flipped")


def truncate(b: Bases, rng: random.Random) -> tuple[str, Path]:
    use_gguf = rng.random() < 0.5
    data = b.gguf_bytes if use_gguf else b.st_bytes
    cut = rng.randrange(len(data))
    if use_gguf:
        return _save(b, "m.gguf", data[:cut], f"gguf truncated to {cut}")
    return _folder(b, b.config, data[:cut], f"safetensors truncated to {cut}")


def safetensors_header(b: Bases, rng: random.Random) -> tuple[str, Path]:
    size = struct.unpack_from("<Q", b.st_bytes)[0]
    header = json.loads(b.st_bytes[8:8 + size])
    name = rng.choice([k for k in header if k != "__metadata__"])
    entry, what = header[name], rng.choice(["dtype", "shape", "offsets", "drop", "length"])
    if what == "dtype":
        entry["dtype"] = rng.choice(["F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "X", 3])
    elif what == "shape":
        entry["shape"] = rng.choice([[], [0], [-1, 64], [2 ** 62, 64], entry["shape"][::-1], entry["shape"] + [1]])
    elif what == "offsets":
        entry["data_offsets"] = [rng.choice(EDGE_INTEGERS), rng.choice(EDGE_INTEGERS)]
    elif what == "drop":
        del header[name]
    raw = json.dumps(header).encode()
    length = rng.choice(EDGE_INTEGERS) if what == "length" else len(raw)
    data = struct.pack("<Q", length % (1 << 64)) + raw + b.st_bytes[8 + size:]
    return _folder(b, b.config, data, f"safetensors header {name} {what} := {entry if what != 'drop' else '-'}")


def config_value(b: Bases, rng: random.Random) -> tuple[str, Path]:
    config = dict(b.config)
    key = rng.choice([*config, "rope_scaling", "quantization_config", "sliding_window", "head_dim"])
    value = rng.choice(ODD_VALUES + ("drop",))
    if value == "drop":
        config.pop(key, None)
    else:
        config[key] = value
    if key == "sliding_window":
        config["model_type"] = "mistral"
    return _folder(b, config, b.st_bytes, f"config.json {key} := {value!r}")


def generation_config_value(b: Bases, rng: random.Random) -> tuple[str, Path]:
    """A generation_config.json beside the unmutated safetensors, with one odd value (or not JSON at all)."""
    folder = write_safetensors(b.work / "st", b.config, b.st_bytes)
    data = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    key = rng.choice([*data, "text"])
    value = rng.choice(ODD_VALUES + ("drop",))
    if key == "text":
        (folder / GENERATION_CONFIG).write_text(rng.choice(["{", "[]", "null", "\x00", ""]))
        return "generation_config.json not an object", folder
    if value == "drop":
        del data[key]
    else:
        data[key] = value
    (folder / GENERATION_CONFIG).write_text(json.dumps(data))
    return f"generation_config.json {key} := {value!r}", folder


MUTATIONS: tuple[Callable[[Bases, random.Random], tuple[str, Path]], ...] = (
    gguf_integer, gguf_integer, gguf_retype, byte_flip, truncate, safetensors_header, config_value,
    generation_config_value)


def _save(b: Bases, name: str, data: bytes | bytearray, description: str) -> tuple[str, Path]:
    path = b.work / name
    path.write_bytes(bytes(data))
    return description, path


def _folder(b: Bases, config: dict[str, Any], weights: bytes, description: str) -> tuple[str, Path]:
    return description, write_safetensors(b.work / "st", config, weights)
