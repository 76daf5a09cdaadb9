"""Each rank loads only its part: the parts equal the whole tensor's, the real SmolLM2 GGUF runs on 3 ranks, and
a rank that cannot load ends every rank with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minilade import LLM
from minilade.decoding import Autoregressive
from tests.parallel.ranks import check_ok, results, run_ranks

SMOLLM2 = Path(__file__).resolve().parents[2] / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="the SmolLM2 GGUF file is not in weights/")
def test_smollm2_on_three_ranks_generates_what_one_process_does(tmp_path):
    check_ok(run_ranks(3, "llm", tmp_path, str(SMOLLM2), PROMPT, timeout_s=120))
    one = LLM.load(SMOLLM2, dtype="float32", device="cpu", progress=False, exact=False)
    want = one.generate(PROMPT, max_new_tokens=8, strategy=Autoregressive()).token_ids
    for got in results(tmp_path, 3):
        assert got["autoregressive"] == want
        assert got["lookahead"] == want
