"""scripts/bench/invariance_cost.py: invariant against stock steps, side by side."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minilade.config import ModelConfig
from minilade.invariance import KeyLayout, apply_exact_attention
from minilade.kv_cache import KVCache
from minilade.model import Transformer
from scripts.bench import invariance_cost


def test_every_size_is_measured_on_both_paths(tmp_path: Path, capsys) -> None:
    argv = ["--preset", "tiny-gqa", "--dtypes", "float32", "bfloat16", "--contexts", "3", "70", "--rows", "1", "9",
            "--repeats", "1", "--no-progress", "--out-dir", str(tmp_path)]
    assert invariance_cost.main(argv) == 0
    record = json.loads((tmp_path / "invariance_cost.json").read_text())
    assert record["exact"] == {"float32": True, "bfloat16": True}  # the invariant copy passed the load-time check
    for dtype in ("float32", "bfloat16"):
        sizes = [(r["context"], r["rows"]) for r in record["results"][dtype]]
        assert sizes == [(3, 1), (3, 9), (70, 1), (70, 9)]
    out = capsys.readouterr().out
    first = record["results"]["float32"][0]
    ratio = first["invariant"] / first["stock"]
    cells = f"{1e3 * first['invariant']:.1f} | {1e3 * first['stock']:.1f} | {ratio:.2f}"
    assert f"| float32 | True | 3 | 1 | {cells} |" in out
    assert (tmp_path / "invariance_cost.png").stat().st_size > 0


def test_stock_model_takes_sdpa_and_plain_linears() -> None:
    """The comparison is only meaningful if the stock copy really leaves the invariant path."""
    model = Transformer(ModelConfig.preset("tiny-gqa")).init_random()
    masks = model.step_masks(None, 5, 2)
    assert isinstance(model.attention_kernel.prepare(*masks, 5, model.dtype), torch.Tensor)  # SDPA's mask
    assert type(model.new_cache(8)) is KVCache  # unpadded cache
    apply_exact_attention(model)  # what make_exact installs on the invariant copy
    assert isinstance(model.attention_kernel.prepare(*masks, 5, model.dtype), KeyLayout)
