"""A server over a model whose decoding steps are native (native_steps.py): its decoding calls share one native
pass, each with its own step's bits, so each answer is the one LLM.generate gives with the same model."""

from __future__ import annotations

import pytest
import torch

from minilade import LLM, integer_linear
from minilade.integer_linear import W7A8Linear
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
    assert all(m.handed_over for m in llm.model.modules() if isinstance(m, W7A8Linear))  # the operator's copy only
    return llm


def test_a_pass_gives_each_call_the_logits_of_the_model_alone(llm):
    """Decoding calls of 1, 4 and 3 rows and a prefill's later part, in one native pass (native steps run prefills
    too): each bitwise what the model alone gives it, cache rows included."""
    model, passes = llm.model, NativePasses.checked(llm.model)
    assert passes is not None
    sizes = [(9, 1), (20, 4), (14, 3)]

    def calls() -> list[ForwardCall]:
        prefill = model.new_cache(64)
        model(torch.arange(20, 26)[None], torch.arange(6), prefill)
        prefill.length = 6  # the first part of a prompt read; the next part follows at rows [6, 10)
        return calls_over(model, sizes) + [ForwardCall(torch.arange(26, 30)[None], torch.arange(6, 10), prefill, None,
                                                       torch.tensor([3]), prefill_part=True)]

    with torch.inference_mode():
        together, alone = calls(), calls()
        assert all(runs_compiled(model, call) for call in together)
        got = batched_forward(model, [prepare_call(model, call) for call in together], passes)
        want = [model(c.tokens, c.input_pos, c.cache, c.mask, c.logits_rows) for c in alone]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a.cache.k, b.cache.k) and torch.equal(a.cache.v, b.cache.v) for a, b in zip(together, alone))
    assert passes.groups([1, 4, 3, 4]) == [[0, 1, 2, 3]]


def test_concurrent_answers_equal_alone_through_native_steps(llm):
    """Greedy auto, lookahead and plain decoding and a seeded sampled request, served together with a long prompt
    read in parts from a kept prefix: every answer is LLM.generate's through the same native steps."""
    served_answers_equal_alone(llm, NativePasses)


def test_a_load_that_keeps_native_steps_never_packs_codes_for_fbgemm(llm, tiny_ckpt, monkeypatch):
    """Once this machine's verdicts are kept (the `llm` fixture's load), LLM.load rounds the layers' weights to codes
    and hands them to the native operator without ever packing them for fbgemm's kernel (which native passes do not
    read): the same answers as the first load's."""
    packs = []
    monkeypatch.setattr(integer_linear, "pack_weight", lambda *args: packs.append(args))
    again = LLM.load(tiny_ckpt, dtype="float32", quantize="w7a8", progress=False)
    assert isinstance(again.model.step_runner, NativeSteps) and not packs, again.setup
    prompt = "the cat sat on the"
    assert again.generate(prompt, max_new_tokens=12).token_ids == llm.generate(prompt, max_new_tokens=12).token_ids


def test_a_models_check_runs_once_and_every_engine_after_it_reuses_the_verdict(llm, monkeypatch):
    import minilade.serve.native_pass as native_pass

    assert NativePasses.checked(llm.model) is not None
    monkeypatch.setattr(native_pass, "calls_over", lambda *args: pytest.fail("the model was probed again"))
    assert NativePasses.checked(llm.model) is not None
