"""The model against transformers' LlamaForCausalLM (an independent implementation), and its KV cache."""

from __future__ import annotations

import pytest
import torch

from minilade.checkpoints import build_model, open_checkpoint
from minilade.invariance import apply_exact_attention
from minilade.model import SDPAttention, Transformer

from .helpers import tiny_model

KERNELS = pytest.mark.parametrize("exact", [False, True], ids=["sdpa", "exact"])  # either attention kernel


def kernel_model(exact: bool, **options) -> Transformer:
    """tiny_model(**options) with the exact attention kernel, or with the plain model's SDPA."""
    model = tiny_model(**options)
    if not exact:
        model.attention_kernel = SDPAttention()
    return model

transformers = pytest.importorskip("transformers")

HF_VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "llama3-rope": dict(num_key_value_heads=2, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "linear-rope": dict(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "bias-headdim": dict(num_key_value_heads=4, attention_bias=True, head_dim=16),
}


def hf_tiny(variant: str, seed: int = 0) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=128,
                                      **HF_VARIANTS[variant])
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():  # default init is too close to zero to tell implementations apart
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_logits_match_transformers(variant: str, tmp_path) -> None:
    """Through our own loader, from the files transformers wrote."""
    hf = hf_tiny(variant)
    hf.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(tmp_path)
    ours = build_model(checkpoint.config, checkpoint.tensors(), dtype=torch.float64, device="cpu")
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens, torch.arange(40), ours.new_cache(64, batch_size=2))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@KERNELS
def test_cached_decoding_equals_uncached(exact: bool) -> None:
    model = kernel_model(exact, vocab=50, dtype=torch.float64)
    tokens = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens, torch.arange(30), model.new_cache(32))
        cache = model.new_cache(32)
        pieces = [model(tokens[:, :7], torch.arange(7), cache)]
        cache.commit(7)
        for chunk in [(7, 8), (8, 13), (13, 14), (14, 30)]:  # single tokens and blocks, both with a prefix
            a, b = chunk
            pieces.append(model(tokens[:, a:b], torch.arange(a, b), cache))
            cache.commit(b - a)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-12)
    assert torch.equal(torch.cat(pieces, dim=1).argmax(-1), full.argmax(-1))


def test_model_and_cache_import_only_the_core() -> None:
    """model.py and kv_cache.py stand alone: what goes beyond a plain LLaMA (exactness, quantization, sharding,
    compiled steps) plugs into them from outside."""
    import ast
    import pathlib

    import minilade
    root = pathlib.Path(minilade.__file__).parent
    for name in ("model.py", "kv_cache.py"):
        tree = ast.parse((root / name).read_text())
        local = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
        assert local <= {"config", "kv_cache"}, (name, local)


def test_logits_rows_selects_rows() -> None:
    model = tiny_model(vocab=50)
    tokens = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([0, 5, 11])
    with torch.no_grad():
        full = model(tokens, torch.arange(12), model.new_cache(16))
        some = model(tokens, torch.arange(12), model.new_cache(16), logits_rows=rows)
    torch.testing.assert_close(some, full[:, rows], rtol=1e-6, atol=1e-6)


@KERNELS
def test_custom_mask_causal_equals_default(exact: bool) -> None:
    model = kernel_model(exact, vocab=50)
    tokens = torch.randint(0, 50, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = model.new_cache(32)
        model(tokens[:, :4], torch.arange(4), cache)
        cache.commit(4)
        default = model(tokens[:, 4:], torch.arange(4, 10), cache)
        explicit = model(tokens[:, 4:], torch.arange(4, 10), cache, mask=torch.ones(6, 6, dtype=torch.bool).tril())
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


@KERNELS
def test_bad_mask_shape_and_capacity_errors(exact: bool) -> None:
    model = kernel_model(exact, vocab=50)
    tokens = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"mask has shape \(4, 4\), expected \(5, 5\)"):
        cache = model.new_cache(16)
        cache.commit(2)
        model(tokens, torch.arange(2, 7), cache, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"capacity exceeded: 0 committed \+ 5 new tokens > capacity 4"):
        model(tokens, torch.arange(5), model.new_cache(4))


def test_bfloat16_forward_close_to_float32() -> None:
    model = tiny_model(vocab=50, std=0.1)
    tokens = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(tokens, torch.arange(16), model.new_cache(16))
        low = model.to(torch.bfloat16)
        low.setup_rope()
        got = low(tokens, torch.arange(16), low.new_cache(16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.05)


@KERNELS
def test_sliding_window_hides_keys_older_than_the_window(exact: bool) -> None:
    """With window w and 2 layers, position q depends only on tokens at positions > q - 2(w - 1): changing the
    first token must leave every later position's logits untouched, in the prefill and in cached decoding steps,
    and change those within reach (else the window hid more than it should)."""
    w = 5
    config = tiny_model(vocab=50).config.replace(sliding_window=w)
    model = Transformer(config).init_random(seed=1, std=0.3).double().eval()
    if exact:
        apply_exact_attention(model)
    tokens = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(4))
    other = tokens.clone()
    other[0, 0] = (tokens[0, 0] + 1) % 50
    reach = 2 * (w - 1)
    with torch.no_grad():
        runs = []
        for seq in (tokens, other):
            cache = model.new_cache(32)
            prefill = model(seq[:, :20], torch.arange(20), cache)[0]
            cache.commit(20)
            steps = []
            for pos in range(20, 30):
                steps.append(model(seq[:, pos:pos + 1], torch.tensor([pos]), cache)[0, 0])
                cache.commit(1)
            runs.append(torch.cat([prefill, torch.stack(steps)]))
    assert torch.equal(runs[0][reach + 1:], runs[1][reach + 1:])
    assert not torch.equal(runs[0][reach], runs[1][reach])


def full_context_tables(config) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables as minilade built them before they grew lazily: every position of the context at once."""
    from minilade.model import rope_inv_freq
    freqs = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), rope_inv_freq(config))
    return torch.cat([freqs.cos(), freqs.cos()], -1), torch.cat([-freqs.sin(), freqs.sin()], -1)


@pytest.mark.parametrize("preset,changes", [("tiny-mha", {}), ("tiny-gqa", {"head_dim": 6, "rope_theta": 5e5}),
                                            ("smollm2-135m", {})])
def test_lazy_rotary_rows_equal_full_context_tables_bit_for_bit(preset: str, changes: dict) -> None:
    """Issue 10 (3): tables sized to the caches made, each row what the full-context table holds (head_dim 6
    and 8 leave vector tails in the full table's cos/sin; 64 is the real model's)."""
    from minilade.config import ModelConfig
    from minilade.model import rope_rows, rope_tables
    config = ModelConfig.preset(preset).replace(max_seq_len=1000, **changes)
    cos_full, sin_full = full_context_tables(config)
    for capacity in (1, 5, 64, 65, 300, 999, 1000, 1100):
        rows = rope_rows(config, capacity)
        assert min(capacity, 1000) <= rows <= min(max(64, 2 * capacity), 1000)
        cos, sin = rope_tables(config, rows, torch.float32, "cpu")
        assert torch.equal(cos, cos_full[:rows]) and torch.equal(sin, sin_full[:rows])


def test_a_huge_declared_context_builds_small_tables_and_positions_past_them_are_errors() -> None:
    from minilade.config import ModelConfig
    from minilade.config_checks import MAX_CONTEXT
    from minilade.model import Transformer
    model = Transformer(ModelConfig.preset("tiny-mha").replace(vocab_size=16, max_seq_len=MAX_CONTEXT)).init_random()
    assert model.rope_cos.shape[0] == 64  # not 2^21 rows (about 1 GB at head_dim 128)
    cache = model.new_cache(100)
    assert model.rope_cos.shape[0] == 128
    with torch.no_grad(), pytest.raises(ValueError, match="rotary position 500 is outside the rotary tables"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.tensor([0, 500]), cache)
    small = tiny_model(vocab=16)  # context 256 (tiny presets)
    with torch.no_grad(), pytest.raises(ValueError, match="rotary position -1 is outside"):
        small(torch.zeros(1, 1, dtype=torch.long), torch.tensor([-1]), small.new_cache(8))
    context = small.config.max_seq_len
    with torch.no_grad(), pytest.raises(ValueError, match=f"position {context} is outside the model's context"):
        small(torch.zeros(1, 1, dtype=torch.long), torch.tensor([context]), small.new_cache(context + 8))
