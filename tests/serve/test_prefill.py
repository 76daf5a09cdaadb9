"""How the server splits a prefill: kept prefixes found and bounded, chunks that keep the logits rows in the last
pass, and logits and K/V that do not depend on the split (the exact kernel runs every prefill row invariantly)."""

from __future__ import annotations

import torch

from minilade.device import make_exact
from minilade.serve.batched import ForwardCall
from minilade.serve.prefill import MIN_REUSE, PrefixCache, chunk_end, prefill_calls
from minilade.text_stream import splits_exactly
from tests.helpers import tiny_model


def chunk_bounds(start: int, T: int, first_logits_row: int, chunk: int) -> list[int]:
    bounds = [start]
    while bounds[-1] < T:
        bounds.append(chunk_end(bounds[-1], T, first_logits_row, chunk))
    return bounds


def test_chunk_bounds_keep_the_logits_rows_in_the_last_pass():
    assert chunk_bounds(0, 300, 299, chunk=128) == [0, 128, 256, 300]
    assert chunk_bounds(40, 300, 299, chunk=128) == [40, 168, 296, 300]
    assert chunk_bounds(0, 300, 200, chunk=128) == [0, 128, 300]
    assert chunk_bounds(0, 100, 99, chunk=128) == [0, 100]


def filled_cache(model, ids: list[int]):
    cache = model.new_cache(len(ids) + 8)
    with torch.inference_mode():
        model(torch.tensor([ids]), torch.arange(len(ids)), cache, logits_rows=torch.tensor([len(ids) - 1]))
    cache.commit(len(ids))
    return cache


def test_prefix_cache_finds_the_longest_shared_prefix_within_its_budget():
    model = tiny_model(vocab=32)
    a, b = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9]
    kept = PrefixCache(1 << 30)
    kept.keep(a, filled_cache(model, a))
    kept.keep(b, filled_cache(model, b))
    assert kept.find([1, 2, 3, 4, 5, 6, 8]).n == 6
    assert kept.find(a).n == len(a) - 1  # the last prompt row is always computed: its logits are needed
    assert kept.find([1, 2, 3, 4, 9, 9, 9, 9]).n == 6
    assert kept.find([1, 2, 7]) is None and MIN_REUSE > 3
    one = PrefixCache(1)  # too small for any entry
    one.keep(a, filled_cache(model, a))
    assert one.find(a) is None


def test_a_prefill_split_anyway_gives_the_bits_of_one_piece():
    """Kept rows, then chunks: the last row's logits and every K/V row are bitwise those of a whole prefill."""
    model = tiny_model(vocab=32)
    make_exact(model)
    assert splits_exactly(model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 32, (1, 150), generator=gen)
    whole = model.new_cache(160)
    with torch.inference_mode():
        expected = model(prompt, torch.arange(150), whole, logits_rows=torch.tensor([149]))
        kept = PrefixCache(1 << 30)
        kept.keep(prompt[0, :70].tolist(), filled_cache(model, prompt[0, :70].tolist()))
        cache = model.new_cache(160)
        call = ForwardCall(prompt, torch.arange(150), cache, None, torch.tensor([149]))
        start, calls = prefill_calls(call, kept.find(prompt[0].tolist()), chunk=32)
        for part in calls:
            logits = model(part.tokens, part.input_pos, part.cache, part.mask, part.logits_rows)
    assert start == 70
    assert torch.equal(logits, expected)
    assert torch.equal(cache.k[:, :, :, :150], whole.k[:, :, :, :150])
    assert torch.equal(cache.v[:, :, :, :150], whole.v[:, :, :, :150])
