"""A server over a model whose decoding steps are native (native_steps.py): its decoding calls share one native
pass, each with its own step's bits, so each answer is the one LLM.generate gives with the same model."""

from __future__ import annotations

import pytest
import torch

from minilade import LLM
from minilade.native_steps import NativeSteps
from minilade.serve.batched import ForwardCall, batched_forward, prepare_call, runs_compiled
from minilade.serve.compiled_pass import calls_over
from minilade.serve.native_pass import NativePasses

from .test_compiled_passes import served_answers_equal_alone


@pytest.fixture(scope="module")
def llm(tiny_ckpt, kept_tables) -> LLM:
    """The tiny checkpoint in w7a8, its steps chosen as LLM.load chooses them: native, where they step faster than
    eager ones (on a model this small, many times faster)."""
    llm = LLM.load(tiny_ckpt, dtype="float32", quantize="w7a8", progress=False)
    assert isinstance(llm.model.step_runner, NativeSteps), llm.setup
    return llm


def test_a_pass_gives_each_call_the_logits_of_the_model_alone(llm):
    """Decoding calls of 1, 4 and 3 rows through one native pass and a prefill's later part through the eager
    layers, in one engine pass: each bitwise what the model alone gives it."""
    model, passes = llm.model, NativePasses.checked(llm.model)
    assert passes is not None
    sizes = [(9, 1), (20, 4), (14, 3)]
    together, alone = calls_over(model, sizes), calls_over(model, sizes)
    with torch.inference_mode():
        prefill = model.new_cache(64)
        model(torch.arange(20, 26)[None], torch.arange(6), prefill)
        prefill.length = 6  # the first part of a prompt read; the next part follows at rows [6, 10)
        part = ForwardCall(torch.arange(26, 30)[None], torch.arange(6, 10), prefill, None, torch.tensor([3]),
                           prefill_part=True)
        assert [runs_compiled(model, call) for call in together + [part]] == [True, True, True, False]
        got = batched_forward(model, [prepare_call(model, call) for call in together + [part]], passes)
        want = [model(c.tokens, c.input_pos, c.cache, c.mask) for c in alone]
        runner, model.step_runner = model.step_runner, None
        try:
            want.append(model(part.tokens, part.input_pos, prefill, None, part.logits_rows))
        finally:
            model.step_runner = runner
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert passes.groups([1, 4, 3]) == [[0, 1, 2]]


def test_concurrent_answers_equal_alone_through_native_steps(llm):
    """Greedy auto, lookahead and plain decoding and a seeded sampled request, served together with a long prompt
    read in parts from a kept prefix: every answer is LLM.generate's through the same native steps."""
    served_answers_equal_alone(llm, NativePasses)
