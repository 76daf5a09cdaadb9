"""Plain decoding through the compiled one-token step (minilade/compiled.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minilade import Autoregressive
from minilade.cli import build_parser, main, settings_from_args
from minilade.compiled import CompiledAutoregressive, CompiledDecoder, compiled_step, one_token_logits
from minilade.config import ModelConfig
from minilade.decoding import make_strategy
from minilade.decoding.loop import GenerationSettings, cache_for
from minilade.invariance import PaddedKVCache
from minilade.kv_cache import KVCache
from minilade.model import Transformer
from minilade.quant import quantize_embedding, quantize_linears
from tests.helpers import run_tokens, tiny_model


def stock_model(sliding_window: int = 0) -> Transformer:
    config = ModelConfig.preset("tiny-gqa").replace(vocab_size=40, sliding_window=sliding_window)
    return Transformer(config).init_random(seed=5, std=0.3).eval()  # the stock kernels, as the compiled step


@pytest.mark.parametrize("sliding_window", [0, 5])
def test_static_step_gives_the_logits_of_the_models_own_step(sliding_window: int) -> None:
    """one_token_logits run eagerly: attention over every slot, later slots masked (and, with a window, older
    ones), against Transformer.forward's one-token steps on the same cache contents."""
    model = stock_model(sliding_window)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    ours, theirs = model.new_cache(24), model.new_cache(24)
    with torch.inference_mode():
        for cache in (ours, theirs):
            model(prompt, torch.arange(prompt.shape[1]), cache)
            cache.commit(prompt.shape[1])
        token = torch.tensor([[7]])
        for _ in range(10):  # past the window: the oldest keys drop out
            pos = torch.tensor([ours.length])
            cos, sin = model.rotary(pos.view(1, 1))
            got = one_token_logits(model, model.tok_embeddings(token), cos, sin, pos, ours.k, ours.v)
            want = model(token, pos, theirs)
            ours.commit(1)
            theirs.commit(1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            token = want[:, -1:].argmax(-1)
    torch.testing.assert_close(ours.k[:, :, :, :ours.length], theirs.k[:, :, :, :theirs.length])


def test_compiled_plain_decoding_gives_the_stock_kernels_tokens() -> None:
    """torch.compile end to end (the first call compiles), two generations of different cache capacity (one
    graph: the slot count is dynamic), a float32 model and an int4 one."""
    model = stock_model()
    int4 = quantize_embedding(quantize_linears(Transformer(ModelConfig.preset("tiny-mha").replace(vocab_size=16))
                                               .init_random(seed=3, std=0.3).eval(), "int4", 32))
    for m, prompts in ((model, ([3, 1, 4], [2, 7, 1, 8, 2, 8])), (int4, ([5, 1],))):
        for prompt in prompts:
            compiled, run = run_tokens(m, prompt, CompiledAutoregressive(), max_new_tokens=20)
            assert compiled == run_tokens(m, prompt, Autoregressive(), max_new_tokens=20)[0]
            assert run.stats.steps == 19 and run.stats.strategy == "autoregressive"


def test_compiled_gets_a_plain_cache_and_refuses_others_and_other_devices() -> None:
    """With the exact attention kernel installed, the model's own cache is padded; the compiled strategy is given
    a plain one, and its decoder refuses any other."""
    model = tiny_model()
    assert type(model.new_cache(8)) is PaddedKVCache
    for strategy, kind in ((CompiledAutoregressive(), KVCache), (Autoregressive(), PaddedKVCache)):
        assert strategy.cache_type(model) is kind
        assert type(cache_for(model, 3, GenerationSettings(strategy, max_new_tokens=4))) is kind
    with pytest.raises(ValueError, match="needs a plain KVCache, not a PaddedKVCache"):
        CompiledDecoder(SimpleNamespace(model=model, cache=model.new_cache(8)))
    with pytest.raises(ValueError, match="CPU only, not meta"):
        compiled_step(tiny_model().to("meta"))
    with pytest.raises(ValueError, match="plain decoding only"):
        make_strategy("lookahead", compiled=True)
    assert make_strategy("autoregressive", compiled=True) == CompiledAutoregressive()
    assert make_strategy("autoregressive", compiled=False) == Autoregressive()


def test_compile_flag_reaches_plain_decoding_only(capsys) -> None:
    on = settings_from_args(build_parser().parse_args(["p", "--strategy", "autoregressive", "--compile"]))
    assert on.strategy == CompiledAutoregressive()
    for strategy in ("lookahead", "auto"):
        assert main(["a", "--ckpt", "/nonexistent.gguf", "--strategy", strategy, "--compile"]) == 2
        err = capsys.readouterr().err
        assert "--compile runs plain decoding only" in err and len(err.strip().splitlines()) == 1
