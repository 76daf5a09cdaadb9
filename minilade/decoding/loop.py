"""The generation loop, written once for every strategy: prefill, steps, budget, EOS, statistics.

decode_tokens() runs any Strategy on token ids and yields the new tokens one at a time; the text layer
(minilade/llm.py) adds tokenization, streaming and stop strings on top.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from ..sampling import Sampler, SamplingParams
from .base import DecodeContext, Strategy


@dataclass
class GenerationStats:
    """What one generation did. A step is one forward pass after the prefill."""

    strategy: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens_per_step: Counter = field(default_factory=Counter)  # tokens emitted by a step -> number of such steps
    step_kinds: Counter = field(default_factory=Counter)  # the decoder's name for a kind of step -> count
    tokens_fed: int = 0  # tokens put through the model by the decoding steps (prefill excluded)

    @property
    def forward_passes(self) -> int:
        return self.steps + 1

    @property
    def compression(self) -> float:
        """New tokens per forward pass, prefill included (1.0 for autoregressive decoding)."""
        return self.new_tokens / self.forward_passes

    @property
    def tokens_per_s(self) -> float:
        """End to end: new tokens over prefill plus decoding time."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total else 0.0

    @property
    def step_ms(self) -> float:
        return 1e3 * self.decode_s / self.steps if self.steps else 0.0

    @property
    def tokens_fed_per_step(self) -> float:
        return self.tokens_fed / self.steps if self.steps else 0.0

    def summary(self) -> str:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.tokens_per_step.items()))
        kinds = ", ".join(f"{k} x{v}" for k, v in self.step_kinds.most_common()) if len(self.step_kinds) > 1 else ""
        return (f"[{self.strategy}] prompt {self.prompt_tokens} tok, new {self.new_tokens} tok in "
                f"{self.forward_passes} passes ({self.compression:.2f} tok/pass), prefill {self.prefill_s * 1e3:.0f} ms, "
                f"decode {self.decode_s * 1e3:.0f} ms ({self.step_ms:.1f} ms/step), {self.tokens_per_s:.1f} tok/s"
                + (f", tokens/step histogram {hist}" if hist else "") + (f", steps: {kinds}" if kinds else ""))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_step"] = {int(k): v for k, v in sorted(self.tokens_per_step.items())}
        d["step_kinds"] = dict(self.step_kinds.most_common())
        d.update(forward_passes=self.forward_passes, compression=self.compression, tokens_per_s=self.tokens_per_s,
                 step_ms=self.step_ms, tokens_fed_per_step=self.tokens_fed_per_step)
        return d


@dataclass
class TokenRun:
    """Outcome of decode_tokens: filled in as tokens are consumed."""

    stats: GenerationStats
    finish_reason: str = ""  # "eos", "length", "context" (or "stop", set by the text layer)


def check_prompt(prompt: Sequence[int], model: Transformer) -> None:
    config = model.config
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= config.max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens but the model's context is {config.max_seq_len} "
                         f"tokens; shorten the prompt")
    bad = [t for t in prompt if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {config.vocab_size})")


def cache_capacity(model: Transformer, prompt_len: int, max_new_tokens: int, strategy: Strategy) -> int:
    """KV cache slots a generation needs: every position it may use, plus room for one step's speculative rows."""
    return min(model.config.max_seq_len, prompt_len + max_new_tokens) + strategy.max_step_tokens()


def decode_tokens(model: Transformer, prompt: Sequence[int], run: TokenRun, *, strategy: Strategy,
                  sampling: SamplingParams, max_new_tokens: int, eos_ids: Sequence[int] = (),
                  cache: KVCache | None = None) -> Iterator[int]:
    """Yield new token ids one at a time until EOS (yielded, then stop), max_new_tokens or the context is full.

    The consumer may stop early (a stop string); run.stats then counts only the tokens it took.
    `cache` is reused when given and large enough.
    """
    check_prompt(prompt, model)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = min(model.config.max_seq_len, len(prompt) + max_new_tokens)
    capacity = cache_capacity(model, len(prompt), max_new_tokens, strategy)
    if cache is None or cache.capacity < capacity:
        cache = model.new_cache(capacity)
    cache.truncate(0)
    ctx = DecodeContext(model, cache, Sampler(sampling, model.device), list(prompt), model.config.max_seq_len)
    stats = run.stats
    stats.strategy, stats.prompt_tokens = strategy.name, len(prompt)
    eos = frozenset(eos_ids)
    with torch.inference_mode():
        decoder = strategy.make_decoder(ctx)
        start = time.perf_counter()
        block = decoder.prefill()
        stats.prefill_s = time.perf_counter() - start
        while True:
            for token in block:
                stats.new_tokens += 1
                if token in eos:
                    run.finish_reason = "eos"
                elif stats.new_tokens >= max_new_tokens:
                    run.finish_reason = "length"
                elif len(prompt) + stats.new_tokens >= limit:
                    run.finish_reason = "context"
                yield token  # the reason is set first, so a consumer that stops at this token sees it
                if run.finish_reason:
                    return
            start = time.perf_counter()
            block = decoder.step()
            stats.decode_s += time.perf_counter() - start
            stats.steps += 1
            stats.tokens_per_step[len(block)] += 1
            stats.step_kinds[decoder.step_kind] += 1
            stats.tokens_fed += decoder.step_tokens
