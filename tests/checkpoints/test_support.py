"""What minilade runs (support.py's listing), and what it refuses: an unsupported family, rope type, attention
variant or tensor type is one line on stderr naming it and what is supported, exit status 2, no weight loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from minilade import cli
from minilade.checkpoints import checkpoint
from minilade.checkpoints.families import FAMILIES
from minilade.checkpoints.gguf import FLOAT_TYPES, QUANTISED_TYPES
from minilade.checkpoints.support import describe_support
from minilade.tokenizer.gguf import PRE_TOKENIZERS


def test_listing_names_every_family_type_and_vocabulary() -> None:
    text = describe_support()
    for family in FAMILIES:
        assert f"{family.name}" in text and f"{family.model_type} / {family.gguf_arch}" in text
    assert all(kind.name in text for kind in {*FLOAT_TYPES, *QUANTISED_TYPES})
    assert all(pre in text for pre in PRE_TOKENIZERS)


def hf_folder(tmp_path: Path, tiny_llama: Callable[..., Any], **config_changes: Any) -> Path:
    folder = tmp_path / "hf"
    tiny_llama("gqa-tied").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def gguf_file(tmp_path: Path, tiny_llama: Callable[..., Any], gguf_tensors: Callable[..., Any],
              write_gguf: Callable[..., Path], arch: str = "llama", q8_1: bool = False) -> Path:
    model = tiny_llama("mha-untied")
    tensors = gguf_tensors(model, QType.F16)
    if q8_1:  # llama.cpp's activation type: no weight uses it, and gguf-py cannot dequantise it
        tensors["blk.0.ffn_up.weight"] = (np.zeros((96, 2 * 40), dtype=np.uint8), QType.Q8_1)
    return write_gguf(tmp_path / "model.gguf", model.config, tensors, arch=arch)


@pytest.mark.parametrize("case, fragments", [
    ("family", ("unsupported architecture 'gemma'", "llama, mistral, qwen2")),
    ("rope", ("unsupported rope scaling type 'yarn'", "default, linear, llama3")),
    ("layer-windows", ("a sliding window on some layers only", "one window for every layer")),
    ("activation", ("unsupported activation 'gelu'", "'silu'")),
    ("gguf-architecture", ("unsupported GGUF architecture 'phi3'", "'llama', 'qwen2'")),
    ("tensor-type", ("tensor blk.0.ffn_up.weight has type Q8_1", "supported: F32, F16")),
])
def test_unsupported_models_exit_2_with_one_line(case: str, fragments: tuple[str, ...], tmp_path: Path,
                                                 tiny_llama: Callable[..., Any], gguf_tensors: Callable[..., Any],
                                                 write_gguf: Callable[..., Path], capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = {
        "family": lambda: hf_folder(tmp_path, tiny_llama, model_type="gemma"),
        "rope": lambda: hf_folder(tmp_path, tiny_llama, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                         "rope_theta": 10000.0}),
        "layer-windows": lambda: hf_folder(tmp_path, tiny_llama, model_type="qwen2", use_sliding_window=True,
                                           sliding_window=8, max_window_layers=1),
        "activation": lambda: hf_folder(tmp_path, tiny_llama, hidden_act="gelu"),
        "gguf-architecture": lambda: gguf_file(tmp_path, tiny_llama, gguf_tensors, write_gguf, arch="phi3"),
        "tensor-type": lambda: gguf_file(tmp_path, tiny_llama, gguf_tensors, write_gguf, q8_1=True),
    }[case]()
    monkeypatch.setattr(checkpoint, "build_model", lambda *a, **k: pytest.fail("weights were loaded"))
    capsys.readouterr()  # what writing the files printed
    assert cli.main(["hello", "--ckpt", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err, err
    assert all(fragment in err for fragment in fragments), err
