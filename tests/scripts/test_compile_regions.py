"""scripts/bench/compile_regions.py: its regions mirror the model exactly, and are undone on exit."""

from __future__ import annotations

import torch

from scripts.bench import compile_regions
from tests.helpers import tiny_model


def test_eager_regions_give_the_models_own_logits_and_are_undone() -> None:
    model = tiny_model(seed=3)
    with torch.inference_mode():
        _, plain = compile_regions.run_steps(model, context=9, steps=4, width=3)
        calls = []

        def counted(fn):
            def run(*args):
                calls.append(fn.__name__)
                return fn(*args)
            return run

        with compile_regions.regions(model, counted):
            _, via_regions = compile_regions.run_steps(model, context=9, steps=4, width=3)
        _, after = compile_regions.run_steps(model, context=9, steps=1, width=3)
    # every decoding step of every layer went through both regions; the prefill did not
    assert calls == ["before_attention", "after_attention"] * (4 * len(model.layers))
    assert all(map(torch.equal, via_regions, plain)) and torch.equal(after[0], plain[0])
    assert all("forward" not in vars(block) for block in model.layers)
