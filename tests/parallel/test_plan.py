"""Which part of each tensor a rank holds, and which rank counts a model allows."""

from __future__ import annotations

import pytest

from minilade.checkpoints.names import checkpoint_tensors
from minilade.config import ModelConfig
from minilade.errors import UnsupportedModelError
from minilade.parallel.plan import ShardPlan, valid_rank_counts

SMOLLM2 = ModelConfig.preset("smollm2-135m")  # 9 query heads, 3 key/value heads, 1536 hidden units


def test_smollm2_splits_over_one_or_three_ranks_and_says_so_otherwise():
    assert valid_rank_counts(SMOLLM2) == [1, 3]
    with pytest.raises(UnsupportedModelError, match=r"over 2 ranks: 2 does not divide its 9 query heads; "
                                                    r"valid rank counts: 1, 3$"):
        ShardPlan(SMOLLM2, 0, 2, SMOLLM2.vocab_size)


def test_rank_config_holds_its_share_and_keeps_the_rest():
    plan = ShardPlan(SMOLLM2, 2, 3, 49152)
    rank = plan.rank_config
    assert (rank.n_heads, rank.n_kv_heads, rank.intermediate_size) == (3, 1, 512)
    assert (rank.dim, rank.head_dim, rank.vocab_size, rank.n_layers) == (576, 64, 49152, 30)


def cuts(plan: ShardPlan) -> dict[str, tuple[int, int, int] | None]:
    return {name.split(".", 3)[-1] if "layers.0." in name else name: plan.cut(spec)
            for name, spec in checkpoint_tensors(plan.config).items() if "layers.1" not in name}


def test_each_tensor_is_cut_along_its_sharded_dimension():
    config = ModelConfig(vocab_size=100, dim=64, n_layers=1, n_heads=8, n_kv_heads=4, intermediate_size=96,
                         qkv_bias=True, o_bias=True)
    got = cuts(ShardPlan(config, 1, 2, vocab=90))  # head_dim 8; the tokenizer's 90 tokens split 45 + 45
    assert got["self_attn.q_proj.weight"] == (0, 32, 64) and got["self_attn.q_proj.bias"] == (0, 32, 64)
    assert got["self_attn.k_proj.weight"] == (0, 16, 32) and got["self_attn.v_proj.weight"] == (0, 16, 32)
    assert got["self_attn.o_proj.weight"] == (1, 32, 64) and got["self_attn.o_proj.bias"] is None
    assert got["mlp.gate_proj.weight"] == got["mlp.up_proj.weight"] == (0, 48, 96)
    assert got["mlp.down_proj.weight"] == (1, 48, 96)
    assert got["lm_head.weight"] == (0, 45, 90)
    assert got["model.embed_tokens.weight"] is None and got["input_layernorm.weight"] is None


def test_key_value_heads_fewer_than_ranks_are_replicated_where_their_queries_are():
    config = ModelConfig(vocab_size=10, dim=96, n_layers=1, n_heads=12, n_kv_heads=2, intermediate_size=96)
    kv = [ShardPlan(config, rank, 6, 10).ranges()["kv_dim"] for rank in range(6)]  # head_dim 8, 2 q heads a rank
    assert kv == [(0, 8)] * 3 + [(8, 16)] * 3  # query heads 0-5 use kv head 0, heads 6-11 use kv head 1
    assert ShardPlan(config, 0, 6, 10).rank_config.n_kv_heads == 1
    assert valid_rank_counts(config) == [1, 2, 4, 6, 12]  # not 3: rank 1 would need both key/value heads


def test_the_last_rank_may_hold_fewer_vocabulary_rows():
    ranges = [ShardPlan(SMOLLM2, rank, 3, 23).ranges()["vocab"] for rank in range(3)]
    assert ranges == [(0, 8), (8, 16), (16, 23)]
