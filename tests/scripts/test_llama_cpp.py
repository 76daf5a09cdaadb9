"""scripts/bench/llama_cpp.py: the llama.cpp peer row, through a stand-in llama-bench and llama_cpp package."""

from __future__ import annotations

import json
import os
import stat
import sys
import types
from pathlib import Path

import pytest

from scripts.bench import llama_cpp


def fake_llama_bench(folder: Path, records: list[dict] | str, exit_code: int = 0) -> Path:
    """An executable `llama-bench` that records its arguments and prints `records` as its JSON output."""
    script = folder / "llama-bench"
    out = records if isinstance(records, str) else json.dumps(records)
    script.write_text(f"#!/bin/sh\necho \"$@\" > {folder / 'args.txt'}\ncat <<'END'\n{out}\nEND\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.fixture
def path_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH holds only tmp_path (and the shell), and no llama_cpp package can be found."""
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/bin{os.pathsep}/usr/bin")
    monkeypatch.setattr(llama_cpp.importlib.util, "find_spec", lambda name: None)
    return tmp_path


def test_llama_bench_rate_is_its_generation_record(path_only: Path) -> None:
    fake_llama_bench(path_only, [dict(n_prompt=0, n_gen=64, avg_ts=151.25), dict(n_prompt=512, n_gen=0, avg_ts=9e3)])
    result = llama_cpp.llama_cpp_decode("model.gguf", threads=2, n_gen=64, repeats=2)
    assert result["status"] == "ran" and result["tokens_per_s"] == 151.25
    assert (path_only / "args.txt").read_text().split() == \
        ["-m", "model.gguf", "-t", "2", "-p", "0", "-n", "64", "-r", "2", "-o", "json"]


@pytest.mark.parametrize("output, code", [("not json", 0), (json.dumps([dict(n_gen=8, avg_ts=1.0)]), 0),
                                          ("[]", 1)])
def test_llama_bench_failures_are_reported_not_raised(path_only: Path, output: str, code: int) -> None:
    fake_llama_bench(path_only, output, exit_code=code)
    result = llama_cpp.llama_cpp_decode("model.gguf", threads=2, n_gen=64)
    assert result["status"] == "failed" and result["tokens_per_s"] is None
    assert result["note"].startswith("llama-bench") and "\n" not in result["note"]


def test_skipped_with_a_note_when_neither_is_installed(path_only: Path) -> None:
    result = llama_cpp.llama_cpp_decode("model.gguf", threads=2, n_gen=64)
    assert result == dict(status="skipped", tokens_per_s=None, how=None,
                          note="neither llama-bench (on PATH) nor llama-cpp-python is installed on this machine")


def test_llama_cpp_python_completions_are_timed(path_only: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class Llama:
        def __init__(self, model_path: str, n_threads: int, n_ctx: int, verbose: bool) -> None:
            calls.append(("load", model_path, n_threads))

        def create_completion(self, prompt: str, max_tokens: int, temperature: float) -> dict:
            calls.append(("complete", max_tokens, temperature))
            return {"usage": {"completion_tokens": max_tokens}}

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    monkeypatch.setattr(llama_cpp.importlib.util, "find_spec", lambda name: object() if name == "llama_cpp" else None)
    result = llama_cpp.llama_cpp_decode("model.gguf", threads=3, n_gen=32, repeats=3)
    assert result["status"] == "ran" and result["tokens_per_s"] > 0
    assert calls == [("load", "model.gguf", 3), ("complete", 4, 0.0)] + [("complete", 32, 0.0)] * 3


def test_peer_runs_on_the_resolved_gguf_file_and_skips_other_formats(path_only: Path) -> None:
    fake_llama_bench(path_only, [dict(n_prompt=0, n_gen=8, avg_ts=100.0)])
    model = path_only / "model.gguf"
    model.write_bytes(b"GGUF")
    assert llama_cpp.llama_cpp_peer(str(model), threads=2, n_gen=8)["tokens_per_s"] == 100.0
    assert (path_only / "args.txt").read_text().split()[:2] == ["-m", str(model)]
    folder = path_only / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    result = llama_cpp.llama_cpp_peer(str(folder), threads=2, n_gen=8)
    assert result["status"] == "skipped" and result["note"].startswith("llama.cpp reads GGUF files")
