"""End-to-end checks on the real SmolLM2-135M-Instruct checkpoint (downloaded on first use)."""

from __future__ import annotations

import pytest
import torch

from minilade.decoding import Autoregressive
from minilade.decoding.lookahead import Lookahead
from minilade.device import make_exact
from minilade.llm import LLM

pytestmark = pytest.mark.real_model

PROMPTS = {
    "code": ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    "prose": ("The three most important inventions of the twentieth century are", False),
    "chat": ("Explain in two sentences why the sky is blue.", True),
    "math": ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?", True),
}


def assert_equal_plain_decoding(llm: LLM, name: str, strategies: tuple, max_new_tokens: int) -> None:
    """Greedy generations of PROMPTS[name] with each of `strategies` give plain decoding's tokens and text, in no
    more forward passes."""
    text, chat = PROMPTS[name]
    reference = llm.generate(text, chat=chat, max_new_tokens=max_new_tokens, strategy=Autoregressive())
    for strategy in strategies:
        got = llm.generate(text, chat=chat, max_new_tokens=max_new_tokens, strategy=strategy)
        assert got.token_ids == reference.token_ids and got.text == reference.text
        assert got.stats.forward_passes <= reference.stats.forward_passes


def assert_prefill_parts_equal_whole(llm: LLM, passes) -> None:
    """A prompt of some 200 tokens read in parts of 16, 32 and 64 rows, each part in a server pass beside another
    request's one-row step (`passes`: the server's pass for the model's step runner, None for eager layers alone),
    gives the last row's logits and every K/V row of the prompt read whole, bit for bit."""
    from minilade.serve.batched import ForwardCall, batched_forward, prepare_call
    from minilade.serve.prefill import prefill_calls

    model = llm.model
    ids = llm.tokenizer.encode(" ".join(text for text, _ in PROMPTS.values()) * 3)[:200]
    T, prompt = len(ids), torch.tensor([ids])
    with torch.inference_mode():
        whole = model.new_cache(T)
        expected = model(prompt, torch.arange(T), whole, logits_rows=torch.tensor([T - 1]))
        other = model.new_cache(T + 16)
        model(prompt[:, :40], torch.arange(40), other)
        other.commit(40)
        for chunk in (16, 32, 64):
            cache = model.new_cache(T)
            _, parts = prefill_calls(ForwardCall(prompt, torch.arange(T), cache, None, torch.tensor([T - 1])), None,
                                     chunk=chunk)
            for part in parts:
                step = ForwardCall(prompt[:, 40:41], torch.tensor([40]), other, None, None)  # never committed
                logits = batched_forward(model, [prepare_call(model, part), prepare_call(model, step)], passes)[0]
            assert torch.equal(logits, expected), chunk
            assert torch.equal(cache.k[:, :, :, :T], whole.k[:, :, :, :T]), chunk
            assert torch.equal(cache.v[:, :, :, :T], whole.v[:, :, :, :T]), chunk


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    return LLM.load(smollm2_gguf, dtype="float32", device="cpu", progress=False, compile=False)


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_equals_transformers(llm, hf_model, name: str) -> None:
    text, chat = PROMPTS[name]
    ids = llm.encode(text, chat=chat)
    ours = llm.generate(ids, max_new_tokens=40)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                eos_token_id=list(llm.tokenizer.eos_ids), pad_token_id=llm.tokenizer.eos_ids[0])
    theirs = out[0, len(ids):].tolist()
    assert ours.token_ids == theirs


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_lookahead_equals_autoregressive(llm, name: str) -> None:
    assert_equal_plain_decoding(llm, name, (Lookahead(window=5, ngram=4, guesses=5),
                                            Lookahead(window=3, ngram=2, guesses=3)), max_new_tokens=64)


@pytest.fixture(scope="module")
def llm_bf16(smollm2_gguf) -> LLM:
    llm = LLM.load(smollm2_gguf, dtype="bfloat16", device="cpu", progress=False, compile=False)
    assert make_exact(llm.model).exact
    return llm


@pytest.mark.parametrize("name", ["chat", "code"])
def test_greedy_lookahead_equals_autoregressive_in_bfloat16(llm_bf16, name: str) -> None:
    """bfloat16 rounds coarsely, so near-tie argmaxes are common: equal only if every step is batch-invariant."""
    text, chat = PROMPTS[name]
    reference = llm_bf16.generate(text, chat=chat, max_new_tokens=48, strategy=Autoregressive())
    got = llm_bf16.generate(text, chat=chat, max_new_tokens=48, strategy=Lookahead(window=5, ngram=4, guesses=5))
    assert got.token_ids == reference.token_ids


def test_lookahead_saves_steps_on_code(llm) -> None:
    text, _ = PROMPTS["code"]
    got = llm.generate(text, max_new_tokens=64, strategy=Lookahead(window=5, ngram=4, guesses=5))
    assert got.stats.compression > 1.2, got.stats.summary()


def test_stream_pieces_concatenate_to_the_text(llm) -> None:
    stream = llm.stream("Write a short poem about the sea.", chat=True, max_new_tokens=48,
                        strategy=Lookahead(window=4, ngram=3, guesses=4))
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text and len(pieces) > 5
    assert "\ufffd" not in stream.result.text


def test_stop_string_cuts_text_like_autoregressive(llm) -> None:
    text, _ = PROMPTS["code"]
    full = llm.generate(text, max_new_tokens=64)
    stop = full.text[20:24]
    for strategy in (Autoregressive(), Lookahead(window=5, ngram=4, guesses=5)):
        cut = llm.generate(text, max_new_tokens=64, stop=[stop], strategy=strategy)
        assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]


def test_chat_ends_at_end_of_turn(llm) -> None:
    out = llm.generate("Say hello.", chat=True, max_new_tokens=200)
    assert out.finish_reason == "eos" and out.token_ids[-1] in llm.tokenizer.eos_ids
    assert "<|im_end|>" not in out.text


def test_prompt_longer_than_context_is_a_clear_error(llm) -> None:
    with pytest.raises(ValueError, match="context is 8192 tokens"):
        llm.generate([1] * 9000)


def test_a_prompt_read_in_parts_through_eager_passes_gives_the_bits_of_one_piece(llm) -> None:
    assert_prefill_parts_equal_whole(llm, None)
