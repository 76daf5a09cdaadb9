"""The server under test: one `python -m minilade.serve` subprocess for the package's tests, over a tiny random
checkpoint written by tests/helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_tiny_checkpoint

from .helpers import API_KEY, CHAT_TEMPLATE, CONTEXT, WORDS, ServerProcess, start_server


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("serve-ckpt"), WORDS, CONTEXT, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="package")
def server(tiny_ckpt) -> ServerProcess:
    """One server for the package's tests, with an API key; stopped by SIGTERM at the end, which must exit 0."""
    server = start_server(tiny_ckpt, "--api-key", API_KEY, "--max-concurrent", "6", "--queue", "4",
                          "--max-body", "65536")
    yield server
    assert server.stop() == 0, server.output()
