"""GGUF files: metadata and tensors (LLaMA architecture), read with the `gguf` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (str, int, float, bool, lists)."""
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}
