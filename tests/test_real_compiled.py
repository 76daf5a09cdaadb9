"""The default configuration on the real SmolLM2-135M-Instruct checkpoint: the file's quantized codes with compiled
steps, exact for every strategy, and the graphs kept for the next process."""

from __future__ import annotations

import json

import pytest

from minilade.decoding.lookahead import Lookahead
from minilade.llm import LLM

from .helpers import run_cli
from .test_real_model import PROMPTS, assert_equal_plain_decoding, assert_prefill_parts_equal_whole

# The graphs compile once (over a minute on 2 cores), in the worker that runs this module's tests.
pytestmark = [pytest.mark.real_model, pytest.mark.xdist_group("real-compiled")]


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    """As LLM.load() loads the demo model by default (dtype, quantization and compiling chosen here, kept in the
    session's tables), except that compiled steps are required whenever they pass the exactness check, whether or
    not they measure faster on this machine."""
    return LLM.load(smollm2_gguf, progress=False, compile=True)


def test_compiled_steps_pass_the_exactness_check(llm) -> None:
    assert "compiled steps" in llm.setup, llm.setup
    assert llm.model.step_runner is not None


@pytest.mark.parametrize("name", ["code", "chat", "math"])
def test_greedy_auto_and_lookahead_equal_plain_decoding_through_compiled_steps(llm, name: str) -> None:
    assert_equal_plain_decoding(llm, name, ("auto", Lookahead(window=5, ngram=4, guesses=5)), max_new_tokens=48)


def test_a_prompt_read_in_parts_beside_compiled_steps_gives_the_bits_of_one_piece(llm) -> None:
    """The server reads a long prompt in parts while other requests take compiled steps (the parts run eagerly):
    here the other request's one-row step runs through the model's own compiled step. Compiled passes that several
    requests share compile graphs of their own (some 10-25 s each on 2 cores), so they are checked on tiny models
    (tests/serve/test_compiled_passes.py)."""
    assert_prefill_parts_equal_whole(llm, None)


def test_the_cli_loads_the_kept_graphs_instead_of_compiling(llm, smollm2_gguf) -> None:
    """A later process (the CLI, with the same tables) finds the graphs the fixture compiled: its setup says compiled
    steps, it compiles nothing, and it gives the library's tokens."""
    text, chat = PROMPTS["code"]
    result = run_cli(text, "--ckpt", str(smollm2_gguf), "--compile", "on", "--max-new-tokens", "24", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert "compiled steps" in out["setup"] and "compiling" not in result.stderr, result.stderr
    want = llm.generate(text, chat=chat, max_new_tokens=24, strategy="auto")
    assert out["token_ids"] == want.token_ids
