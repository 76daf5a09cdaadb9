"""Resolution (minilade.checkpoints.resolve): the demo alias, local files and folders, what is not a checkpoint.
Hub repo ids are in test_download.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
from gguf import GGMLQuantizationType as QType
from transformers import LlamaForCausalLM

from minilade.checkpoints import (
    DEFAULT_CHECKPOINT,
    default_weights_dir,
    open_checkpoint,
    resolve,
    resolve_checkpoint,
)
from minilade.checkpoints.download import SMOLLM2_135M_INSTRUCT_Q4_1

REPO_ROOT = Path(__file__).resolve().parents[2]
TinyLlama = Callable[..., LlamaForCausalLM]
OneLineError = Callable[..., str]


@pytest.mark.parametrize("alias", [DEFAULT_CHECKPOINT, "default", None])
def test_default_alias_reuses_the_downloaded_file(tmp_path: Path, smollm2_gguf: Path, alias: str | None,
                                                  forbid_pip: Callable[[], None]) -> None:
    forbid_pip()
    (tmp_path / SMOLLM2_135M_INSTRUCT_Q4_1.filename).symlink_to(smollm2_gguf)
    assert resolve_checkpoint(alias, weights_dir=tmp_path) == tmp_path / SMOLLM2_135M_INSTRUCT_Q4_1.filename


def test_default_weights_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MINILADE_WEIGHTS", str(tmp_path / "w"))
    assert default_weights_dir() == tmp_path / "w"
    monkeypatch.delenv("MINILADE_WEIGHTS")
    assert default_weights_dir() == REPO_ROOT / "weights"  # this checkout has weights/.gitignore
    monkeypatch.setattr(resolve, "__file__", str(tmp_path / "site-packages" / "minilade" / "weights" / "resolve.py"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_weights_dir() == tmp_path / "home" / ".cache" / "minilade" / "weights"


def test_local_files_and_folders(tmp_path: Path, tiny_llama: TinyLlama, gguf_tensors: Callable[..., Any],
                                 write_gguf: Callable[..., Path], assert_one_line_error: OneLineError) -> None:
    model = tiny_llama("gqa-tied")
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    assert resolve_checkpoint(hf_dir) == hf_dir
    assert resolve_checkpoint(str(hf_dir)) == hf_dir

    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    gguf_file = write_gguf(gguf_dir / "tiny.gguf", model.config, gguf_tensors(model, QType.F16))
    assert resolve_checkpoint(gguf_file) == gguf_file
    assert resolve_checkpoint(gguf_dir) == gguf_file  # a folder with exactly one .gguf
    assert open_checkpoint(gguf_dir, progress=False).format == "gguf"

    (gguf_dir / "second.gguf").write_bytes(b"")
    assert_one_line_error(lambda: resolve_checkpoint(gguf_dir), "2 .gguf files (second.gguf, tiny.gguf)")
    assert_one_line_error(lambda: resolve_checkpoint(hf_dir / "config.json"), "config.json is not a checkpoint")


@pytest.mark.parametrize("files, fragment", [
    ([], "holds no checkpoint: expected config.json with model.safetensors"),
    (["config.json", "pytorch_model.bin"], "has config.json but no model.safetensors or model.safetensors.index"
                                           ".json (only safetensors weights are loaded, not PyTorch .bin/.pth"),
    (["model.safetensors"], "has safetensors weights but no config.json"),
])
def test_folder_without_a_checkpoint(tmp_path: Path, files: list[str], fragment: str,
                                     assert_one_line_error: OneLineError) -> None:
    for name in files:
        (tmp_path / name).write_text("{}")
    assert_one_line_error(lambda: resolve_checkpoint(tmp_path), str(tmp_path), fragment)


@pytest.mark.parametrize("text", ["/no/such/dir", "./missing", "~/missing-minilade-ckpt", "model.gguf",
                                  "weights/x.gguf"])
def test_missing_paths(text: str, assert_one_line_error: OneLineError) -> None:
    assert_one_line_error(lambda: resolve_checkpoint(text), f"checkpoint not found: {text}")


@pytest.mark.parametrize("text", ["not a checkpoint", "a/b/c", "owner/"])
def test_neither_path_nor_repo_id(text: str, assert_one_line_error: OneLineError) -> None:
    assert_one_line_error(lambda: resolve_checkpoint(text), "is not an existing path, a Hugging Face repo id")
