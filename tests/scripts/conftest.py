"""Fixtures of the benchmark-job tests: a tiny random checkpoint and a tiny prompt set (no real weights or data).
The tests check the plumbing and the arithmetic (tables, JSON, plots, errors), never speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ..helpers import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random LLaMA folder with a byte-level BPE tokenizer and a minimal chat template."""
    pytest.importorskip("transformers")
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    torch.manual_seed(0)  # transformers initialises the weights at random: the same model in every session
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "a b c d hello world def return",
                                 max_positions=256, chat_template=template)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The three prompt files with the fields the jobs read, two records each."""
    folder = tmp_path_factory.mktemp("data")
    rows = {
        "mt_bench.jsonl": [{"turns": ["hello world a b", "second turn"]}, {"turns": ["a b c d a b c d", "x"]}],
        "humaneval.jsonl": [{"prompt": "def hello(a, b):\n    return a b"}, {"prompt": "def world():\n"}],
        "gsm8k_test.jsonl": [{"question": "a b c d hello", "answer": "4"}, {"question": "world world", "answer": "1"}],
    }
    for name, records in rows.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.fixture(autouse=True)
def restore_threads():
    """The timed jobs below run with --threads 1 (tiny matmuls gain nothing from threads, and lose much on a busy
    machine); the jobs set it process-wide, so put it back for the other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def stderr_line(capsys):
    """Reads what a job wrote to stderr, which must be exactly one line, and returns it."""
    def read() -> str:
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    return read
