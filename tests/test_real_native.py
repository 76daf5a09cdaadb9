"""Native steps on the real SmolLM2-135M-Instruct checkpoint in w7a8 (the default configuration where they measure
faster than eager steps): exact by the load-time check, and every strategy gives plain decoding's output."""

from __future__ import annotations

import pytest

from minilade.decoding.lookahead import Lookahead
from minilade.device import check_invariance
from minilade.llm import LLM
from minilade.native_steps import NativeSteps, native_missing
from minilade.serve.native_pass import NativePasses

from .helpers import assert_next_turns_answer_as_alone
from .test_real_model import assert_equal_plain_decoding, assert_prefill_parts_equal_whole

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    """The demo model in w7a8 with native steps, installed whether or not they measure faster on this machine."""
    llm = LLM.load(smollm2_gguf, quantize="w7a8", progress=False, compile=False)
    assert native_missing(llm.model) is None
    llm.model.step_runner = NativeSteps()
    return llm


def test_native_steps_pass_the_exactness_check(llm) -> None:
    assert check_invariance(llm.model)


@pytest.mark.parametrize("name", ["code", "chat", "math"])
def test_greedy_auto_and_lookahead_equal_plain_decoding_through_native_steps(llm, name: str) -> None:
    assert_equal_plain_decoding(llm, name, ("auto", Lookahead(window=5, ngram=4, guesses=5)), max_new_tokens=48)


def test_a_prompt_read_in_parts_through_native_passes_gives_the_bits_of_one_piece(llm) -> None:
    assert_prefill_parts_equal_whole(llm, NativePasses.checked(llm.model))


def test_a_chats_next_turn_starts_from_the_last_turns_rows_through_native_steps(llm) -> None:
    """Native steps run prefills too, so the next turn of a chat keeps the last prompt's and answer's rows and
    answers as it does alone."""
    messages = [{"role": "user", "content": "Name a river in Europe."}]
    assert_next_turns_answer_as_alone(llm, llm.encode(messages), llm.encode(" And one in Asia?"), max_new_tokens=16)
