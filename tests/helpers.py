"""Small shared builders for tests."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import torch

from minilade.config import ModelConfig
from minilade.decoding import Autoregressive, GenerationSettings, GenerationStats, Strategy, TokenRun, decode_tokens
from minilade.decoding.step_costs import StepCosts
from minilade.invariance import PaddedKVCache, apply_exact_attention
from minilade.masks import interleaved_step
from minilade.model import Transformer
from minilade.penalties import TokenHistory
from minilade.sampling import SamplingParams, warp


def tiny_model(vocab: int = 16, seed: int = 0, std: float = 0.3, preset: str = "tiny-gqa",
               dtype: torch.dtype = torch.float32) -> Transformer:
    """A random tiny model running the exact attention kernel (cheap: device.make_exact also measures row tilings
    for the linear layers and checks the whole model). A small vocabulary and large weights make its greedy output
    repetitive, so lookahead finds n-grams to verify."""
    config = ModelConfig.preset(preset).replace(vocab_size=vocab)
    return apply_exact_attention(Transformer(config).init_random(seed=seed, std=std).to(dtype).eval())


def run_tokens(model: Transformer, prompt: Sequence[int], strategy: Strategy, *, max_new_tokens: int = 40,
               sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = ()) -> tuple[list[int], TokenRun]:
    run = TokenRun(GenerationStats())
    settings = GenerationSettings(strategy, sampling, max_new_tokens)
    tokens = list(decode_tokens(model, prompt, run, settings, eos_ids=eos_ids))
    return tokens, run


def checked_runs(model, seed: int, strategies: list, trials: int = 3, max_new_tokens: int = 48) -> list:
    """(strategy, run) of every strategy on `trials` random prompts, each output asserted equal to autoregressive."""
    gen = torch.Generator().manual_seed(seed)
    runs = []
    for trial in range(trials):
        length = int(torch.randint(1, 24, (1,), generator=gen))
        prompt = torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
        expected, _ = run_tokens(model, prompt, Autoregressive(), max_new_tokens=max_new_tokens)
        for strategy in strategies:
            got, run = run_tokens(model, prompt, strategy, max_new_tokens=max_new_tokens)
            assert got == expected, (prompt, strategy)
            runs.append((strategy, run))
    return runs


class HalfRoundedCache(PaddedKVCache):
    """A PaddedKVCache whose keys and values are rounded to float16 as they are written (and kept in float32): what
    an eager step would read from a runner's float16 cache."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().write(layer, k.half().float(), v.half().float())


def step_eagerly_and_by(model: Transformer, runner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of one lookahead-shaped step of 8 rows after a 9-token prompt, and the keys written to the cache, with
    the model's steps eager and then run by `runner` (a step_runner): ([eager, runner's] logits, [eager, runner's]
    keys of the 17 rows), for tests that a runner computes the model's step. Where the runner keeps its caches in
    float16, the eager step's keys and values are rounded as they are written too."""
    prompt = torch.randint(model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    positions, mask = interleaved_step(9, 8, lanes=4)
    logits, keys = [], []
    eager_cache = HalfRoundedCache if getattr(runner, "cache_dtype", None) == torch.float16 else None
    with torch.inference_mode():
        for step_runner in (None, runner):
            model.step_runner = step_runner
            cache = model.new_cache(40, cache_type=eager_cache if step_runner is None else None)
            model(prompt, torch.arange(9), cache)
            cache.commit(9)
            logits.append(model(torch.arange(8)[None] % 16, positions, cache, mask))
            keys.append(cache.k[:, :, :, :17].clone())
    return logits, keys


def costs_of(seconds: Callable[[int], float]) -> StepCosts:
    """Step costs given by a formula instead of measured (every size a test step can feed)."""
    return StepCosts({T: seconds(T) for T in range(1, 128)})


FLAT_COSTS = costs_of(lambda T: 1.0)  # every step costs the same: auto feeds its whole budget


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """python -m minilade.generate with these arguments, its output captured; eager steps unless the arguments say
    --compile (a test of anything else should not wait for a graph to compile on a machine where compiling pays)."""
    eager = [] if "--compile" in args else ["--compile", "off"]
    return subprocess.run([sys.executable, "-m", "minilade.generate", *args, *eager], input=stdin,
                          capture_output=True, text=True, timeout=300)


def assert_cli_error(result: subprocess.CompletedProcess, fact: str) -> None:
    """The run failed with exit status 2 and one line on stderr that states `fact`, no traceback (beside the lines
    of what this run may have done first for the machine: a C++ operator's build, a measurement kept)."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines()
             if not line.startswith(("minilade: building", "minilade: measuring"))]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fact in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def write_tiny_checkpoint(folder: Path, words: str, max_positions: int, chat_template: str | None = None,
                          vocab_padding: int = 0) -> Path:
    """A random tiny LLaMA folder as transformers writes it, with a byte-level BPE tokenizer trained on `words`
    (and chat_template.jinja when given): a real checkpoint for CLI and script tests that needs no download.
    vocab_padding: embedding rows past the tokenizer's last token, as many real checkpoints have."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([words] * 10, trainer)
    tok.save(str(folder / "tokenizer.json"))
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size() + vocab_padding, hidden_size=32,
                                      intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)  # transformers initialises at random: the same tiny model in every session
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# ---- distributions of whole continuations, for the statistical tests of sampling ---------------------------------

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
LENGTH = 4


def exact_distribution(model: Transformer, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Probability of every LENGTH-token continuation of PROMPT under autoregressive sampling, by enumeration."""
    vocab = model.config.vocab_size
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(LENGTH):
            grown = {}
            for prefix, p in probs.items():
                tokens = torch.tensor([PROMPT + list(prefix)])
                logits = model(tokens, torch.arange(tokens.shape[1]), model.new_cache(32))[0, -1]
                if params.penalized:  # with the history plain decoding has at this point
                    history = TokenHistory(params, PROMPT, vocab, "cpu")
                    history.add(prefix)
                    logits = history.penalize(logits)
                nxt = warp(logits, params)
                grown.update({prefix + (t,): p * float(nxt[t]) for t in range(vocab) if nxt[t] > 0})
            probs = grown
    return probs


def chi_square_p_value(counts: Counter, expected: dict[tuple[int, ...], float], n: int) -> float:
    """Goodness of fit; outcomes expected fewer than 5 times are pooled into one bin."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for outcome, p in expected.items():
        e = n * p
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[outcome], pooled_exp + e
            continue
        stat += (counts[outcome] - e) ** 2 / e
        df += 1
    unexpected = sum(c for o, c in counts.items() if o not in expected)
    pooled_obs += unexpected
    pooled_exp = max(pooled_exp, 1e-9)
    stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
    df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_counts(model: Transformer, strategy: Strategy, params: SamplingParams, n: int) -> tuple[Counter, int]:
    """How often each continuation of PROMPT came out of n seeded generations, and how many steps emitted more
    than one token (so a test can tell whether drafts were accepted at all)."""
    counts, steps_with_acceptance = Counter(), 0
    for seed in range(n):
        tokens, run = run_tokens(model, PROMPT, strategy, max_new_tokens=LENGTH,
                                 sampling=dataclasses.replace(params, seed=seed))
        counts[tuple(tokens)] += 1
        steps_with_acceptance += sum(c for k, c in run.stats.tokens_per_step.items() if k > 1)
    return counts, steps_with_acceptance


def assert_next_turns_answer_as_alone(llm, first_prompt: list[int], more: list[int], *, answer_kept: bool = True,
                                      max_new_tokens: int = 12) -> None:
    """A prompt that begins with an earlier generation's prompt and answer (a chat's next turn) reads only the rest
    of itself from the K/V that generation left (all but the last of its rows, or its prompt's alone where
    `answer_kept` is False), and its answer and every K/V row it leaves are bitwise the ones it gets with nothing
    kept: greedy plain decoding, lookahead and auto, and auto sampled with a seed. The reply's prefill runs in one
    part and in several (PREFILL_ROWS)."""
    cases = [("autoregressive", {}), ("lookahead", {}), ("auto", {}), ("auto", {"temperature": 0.8, "seed": 3})]
    for strategy, sampling in cases:
        options = dict(max_new_tokens=max_new_tokens, strategy=strategy, **sampling)
        first = llm.generate(first_prompt, **options)
        following = first.prompt_ids + first.token_ids + more
        reply = llm.generate(following, **options)
        least = len(first.prompt_ids) + len(first.token_ids) - 1 if answer_kept else len(first.prompt_ids)
        assert least <= reply.stats.kept_tokens < len(following), (strategy, reply.stats.kept_tokens)
        assert answer_kept or reply.stats.kept_tokens == least
        cache, ids = llm._take_cache()
        k, v = cache.k[:, :, :, :len(ids)].clone(), cache.v[:, :, :, :len(ids)].clone()
        llm._give_back_cache(cache, ids)
        llm.drop_kept_rows()
        alone = llm.generate(following, **options)
        assert alone.stats.kept_tokens == 0
        assert reply.token_ids == alone.token_ids, (strategy, sampling)
        cache, alone_ids = llm._take_cache()
        assert alone_ids[:len(ids)] == ids
        assert torch.equal(cache.k[:, :, :, :len(ids)], k) and torch.equal(cache.v[:, :, :, :len(ids)], v), strategy
