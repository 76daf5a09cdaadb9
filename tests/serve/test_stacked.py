"""Stacked attention (minilade/serve/stacked.py): the calls of a shared pass that attend as one get, bit for bit,
what each gets alone; a pass of such calls gives each the logits of Transformer.forward."""

from __future__ import annotations

import copy

import pytest
import torch

from minilade.config import ModelConfig
from minilade.device import make_exact
from minilade.invariance import ExactAttention, PaddedKVCache, key_layout
from minilade.model import Transformer, in_window, step_visibility
from minilade.serve.batched import ForwardCall, batched_forward, prepare_call
from minilade.serve.stacked import attend_stacked, stacks

CONFIG = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=6, n_kv_heads=2, intermediate_size=128,
                     max_seq_len=512)


def filled_cache(past: int, capacity: int, dtype: torch.dtype, gen: torch.Generator) -> PaddedKVCache:
    cache = PaddedKVCache(CONFIG, capacity, batch_size=1, dtype=dtype, device="cpu")
    shape = (1, CONFIG.n_kv_heads, past, CONFIG.head_dim)
    cache.write(0, torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
    cache.length = past
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, window", [(1, 0), (3, 0), (1, 100)])
def test_stacked_calls_attend_bitwise_as_alone(dtype: torch.dtype, T: int, window: int) -> None:
    """Causal steps past caches of every length class (inside one key chunk, across several, one cache smaller than
    the longest call's keys), with and without a sliding window that hides a call's oldest keys."""
    gen = torch.Generator().manual_seed(T + window)
    pasts, capacities = [5, 63, 64, 130, 250, 31], [512, 512, 512, 512, 512, 40]
    kernel, G = ExactAttention(CONFIG.n_heads // CONFIG.n_kv_heads), CONFIG.n_heads // CONFIG.n_kv_heads
    caches = [filled_cache(p, c, dtype, gen) for p, c in zip(pasts, capacities)]
    steps = []
    for past in pasts:
        reach = step_visibility(None, past, T, "cpu")
        visible = reach & in_window(torch.arange(past, past + T), past, window) if window else reach
        steps.append(key_layout(visible, past, G, dtype, counted=reach if window else None))
    if window:
        assert not bool(steps[4].key_bias[0, :100].eq(0).all()), "the window hides none of the longest call's keys"
    q = torch.randn(len(pasts), CONFIG.n_heads, T, CONFIG.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(len(pasts), CONFIG.n_kv_heads, T, CONFIG.head_dim, generator=gen).to(dtype) for _ in "kv")

    alone_caches = copy.deepcopy(caches)
    alone = [kernel(q[b:b + 1], k[b:b + 1], v[b:b + 1], alone_caches[b], 0, steps[b]) for b in range(len(pasts))]
    [stack] = stacks(steps)
    assert stack.members == tuple(range(len(pasts)))
    together = attend_stacked(stack, q, k, v, caches, 0)
    for b in range(len(pasts)):
        assert torch.equal(together[b:b + 1], alone[b]), pasts[b]
        assert torch.equal(caches[b].k, alone_caches[b].k) and torch.equal(caches[b].v, alone_caches[b].v)


def test_only_causal_steps_of_one_shape_stack() -> None:
    G, dtype = 3, torch.float32
    one_row = [key_layout(step_visibility(None, past, 1, "cpu"), past, G, dtype) for past in (4, 90, 7)]
    two_rows = key_layout(step_visibility(None, 9, 2, "cpu"), 9, G, dtype)
    branching = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a lookahead-like step
    tree = key_layout(step_visibility(branching, 12, 3, "cpu"), 12, G, dtype)
    assert tree.tail_select is not None
    found = stacks([one_row[0], tree, one_row[1], two_rows, None, one_row[2]])
    assert [s.members for s in found] == [(0, 2, 5)]
    assert found[0].layout.key_bias.shape == (3, 1, one_row[1].rows, one_row[1].keys)
    assert stacks([one_row[0], two_rows]) == []


def test_a_pass_of_stacked_and_unstacked_calls_gives_each_its_logits_alone() -> None:
    """Plain one-row steps (stacked), a lookahead-shaped step and a prefill in one pass through an exact model."""
    model = Transformer(CONFIG.replace(n_layers=2)).init_random(seed=3, std=0.3).eval()
    assert make_exact(model).exact
    gen = torch.Generator().manual_seed(1)
    calls = []
    for past, T, mask in [(20, 1, None), (70, 1, None), (0, 9, None), (33, 1, None),
                          (15, 3, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))]:
        cache = model.new_cache(256)
        if past:
            with torch.inference_mode():
                model(torch.randint(0, 64, (1, past), generator=gen), torch.arange(past), cache)
            cache.length = past
        positions = torch.arange(past, past + T)
        calls.append(ForwardCall(torch.randint(0, 64, (1, T), generator=gen), positions, cache, mask))
    with torch.inference_mode():
        alone = [model(c.tokens, c.input_pos, copy.deepcopy(c.cache), c.mask) for c in calls]
        prepared = [prepare_call(model, c) for c in calls]
        assert [s.members for s in stacks([p.step for p in prepared])] == [(0, 1, 3)]
        together = batched_forward(model, prepared)
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
