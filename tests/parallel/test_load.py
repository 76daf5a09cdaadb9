"""Each rank loads only its part: GGUF parts equal the same parts of the whole tensors (rows, columns on and off
block boundaries, rotary heads), and the real SmolLM2 GGUF on 3 ranks generates what one process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minilade import LLM
from minilade.checkpoints.gguf import open_gguf, to_torch, unpermute_rotary
from minilade.checkpoints.names import checkpoint_tensors
from minilade.decoding import Autoregressive
from minilade.parallel.load import gguf_part, gguf_part_reader
from minilade.parallel.plan import ShardPlan
from tests.parallel.ranks import check_ok, results, run_ranks

PROMPT = "The capital of France is"


@pytest.mark.parametrize("cut", [(0, 64, 128), (1, 192, 384), (1, 100, 200)])  # rows; whole blocks; mid-block
def test_a_gguf_part_equals_the_same_part_of_the_whole_tensor(cut, smollm2_gguf: Path):
    tensor = open_gguf(smollm2_gguf).by_name["model.layers.0.self_attn.o_proj.weight"]  # Q4_1, blocks of 32 columns
    whole = to_torch(tensor, smollm2_gguf)
    axis, start, stop = cut
    want = whole[start:stop] if axis == 0 else whole[:, start:stop]
    assert torch.equal(gguf_part(tensor, cut, smollm2_gguf), want)


def test_each_rank_gets_its_own_query_and_key_heads_in_rotate_half_layout(smollm2_gguf: Path):
    source = open_gguf(smollm2_gguf)
    specs = checkpoint_tensors(source.config)
    for name, heads in (("model.layers.0.self_attn.q_proj.weight", 9), ("model.layers.0.self_attn.k_proj.weight", 3)):
        whole = unpermute_rotary(to_torch(source.by_name[name], smollm2_gguf), heads)
        for rank in range(3):
            plan = ShardPlan(source.config, rank, 3, 49152)
            _, start, stop = plan.cut(specs[name])
            assert torch.equal(gguf_part_reader(source, plan)(specs[name], plan.cut(specs[name])), whole[start:stop])


def test_smollm2_on_three_ranks_generates_what_one_process_does(tmp_path, smollm2_gguf: Path):
    check_ok(run_ranks(3, "llm", tmp_path, str(smollm2_gguf), PROMPT, timeout_s=120))
    one = LLM.load(smollm2_gguf, dtype="float32", device="cpu", progress=False, compile=False)
    want = one.generate(PROMPT, max_new_tokens=8, strategy=Autoregressive()).token_ids
    for got in results(tmp_path, 3):
        assert got["autoregressive"] == want
        assert got["lookahead"] == want
