"""The GGUF container parser (minilade.checkpoints.gguf_file): the same metadata and tensors as gguf.GGUFReader
on honest files, and one CheckpointError naming the file, in bounded time, for lengths that do not fit."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from minilade.checkpoints import UnsupportedCheckpointError, open_checkpoint
from minilade.checkpoints.gguf_file import MAX_ARRAY_ITEMS, read_gguf_file

OneLineError = Callable[..., str]


def write_small_gguf(path: Path, *, n_tokens: int = 6) -> Path:
    """A GGUF file with every metadata value type, a token-type array and tensors of a float and a quantised
    type; not a model (open_checkpoint rejects it), a container test subject."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("test.u32", 7)
    writer.add_int64("test.i64", -3)
    writer.add_float32("test.f32", 0.1)
    writer.add_float64("test.f64", 2.5)
    writer.add_bool("test.bool", True)
    writer.add_string("test.text", "héllo")
    writer.add_token_list([f"t{i}" for i in range(n_tokens)])
    writer.add_token_types([1] * n_tokens)
    writer.add_array("test.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 8)).astype(np.float32))
    writer.add_tensor("b.weight", gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), QType.Q8_0),
                      raw_dtype=QType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def offset_after(path: Path, key: str) -> int:
    """Byte offset just after a metadata key's name (where its value type starts)."""
    data = path.read_bytes()
    raw = key.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def patch(path: Path, offset: int, fmt: str, value: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))


def test_same_metadata_and_tensors_as_gguf_reader(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "small.gguf")
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(path)
    assert ours.metadata == {name: field.contents() for name, field in theirs.fields.items()
                             if not name.startswith("GGUF.")}
    assert ours.metadata["test.text"] == "héllo" and ours.metadata["tokenizer.ggml.token_type"] == [1] * 6
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type and mine.n_bytes == reference.n_bytes
        assert mine.data.shape == reference.data.shape and np.array_equal(mine.data, reference.data), mine.name


@pytest.mark.real_model
def test_real_model_metadata_matches_gguf_reader(smollm2_gguf: Path) -> None:
    ours, theirs = read_gguf_file(smollm2_gguf), gguf.GGUFReader(smollm2_gguf)
    assert ours.metadata == {n: f.contents() for n, f in theirs.fields.items() if not n.startswith("GGUF.")}
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_array_length_of_2_to_the_62_fails_at_once(tmp_path: Path, assert_one_line_error: OneLineError) -> None:
    """A file on which gguf's own reader loops for over a minute with memory growing is refused quickly."""
    path = write_small_gguf(tmp_path / "huge-array.gguf")
    patch(path, offset_after(path, "tokenizer.ggml.token_type") + 8, "<Q", 2 ** 62)  # after value and item types
    start = time.perf_counter()
    assert_one_line_error(lambda: open_checkpoint(path, progress=False), str(path),
                          "'tokenizer.ggml.token_type' claims 4611686018427387904 items")
    assert time.perf_counter() - start < 1.0


def test_metadata_arrays_are_limited_in_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              assert_one_line_error: OneLineError) -> None:
    from minilade.checkpoints import gguf_file

    path = write_small_gguf(tmp_path / "many.gguf", n_tokens=40)
    monkeypatch.setattr(gguf_file, "MAX_ARRAY_ITEMS", 60)  # 40 tokens + 40 types + 2 floats
    assert MAX_ARRAY_ITEMS >= 1 << 20  # a real vocabulary (tokens, types, scores, merges) fits the real limit
    assert_one_line_error(lambda: read_gguf_file(path), str(path), "over minilade's limit of 60")


@pytest.mark.parametrize("damage, fragment", [
    (lambda p: patch(p, 8, "<Q", 2 ** 40), "cannot fit"),  # tensor count
    (lambda p: patch(p, offset_after(p, "test.u32"), "<I", 99), "unknown value type 99"),
    (lambda p: patch(p, offset_after(p, "test.text") + 4, "<Q", 2 ** 63), "the remaining"),
    (lambda p: patch(p, offset_after(p, "test.text") + 12, "<B", 0xFF), "is not UTF-8 text"),
    (lambda p: patch(p, offset_after(p, "a.weight"), "<I", 5), "has 5 dimensions"),
    (lambda p: patch(p, offset_after(p, "a.weight") + 4, "<Q", 2 ** 60), "extends past the end of the file"),
    (lambda p: patch(p, offset_after(p, "a.weight") + 20, "<I", 1000), "has unknown type 1000"),
    (lambda p: patch(p, offset_after(p, "b.weight") + 4, "<Q", 48), "not a multiple of Q8_0's block of 32"),
    (lambda p: patch(p, offset_after(p, "b.weight") + 24, "<Q", 2 ** 63), "extends past the end of the file"),
    (lambda p: patch(p, 4, "<I", 1), "version 1"),
], ids=["tensor-count", "value-type", "string-length", "utf-8", "n-dims", "dim", "tensor-type", "block",
        "offset", "version"])
def test_lengths_and_types_that_do_not_fit(damage: Callable[[Path], None], fragment: str, tmp_path: Path,
                                           assert_one_line_error: OneLineError) -> None:
    path = write_small_gguf(tmp_path / "damaged.gguf")
    damage(path)
    message = assert_one_line_error(lambda: read_gguf_file(path), str(path), "not a valid GGUF file")
    assert fragment in message or (fragment == "the remaining" and "are left" in message), message


def test_big_endian_file_is_unsupported(tmp_path: Path, assert_one_line_error: OneLineError) -> None:
    path = write_small_gguf(tmp_path / "big-endian.gguf")
    patch(path, 4, ">I", 3)
    assert_one_line_error(lambda: read_gguf_file(path), str(path), "big-endian", kind=UnsupportedCheckpointError)
