"""The generation loop, written once for every strategy: prefill, steps, budget, EOS, statistics.

decode_tokens() runs any Strategy on token ids and yields the new tokens one at a time; the text layer
(minilade/llm.py) adds tokenization, streaming and stop strings on top. Every settings object checks its own
fields when made (SamplingParams, the strategies, GenerationSettings), so settings are valid before any model runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ..frame_stack import on_fresh_frame_chunk
from ..kv_cache import KVCache
from ..model import Transformer
from ..sampling import Sampler, SamplingParams, seeded
from .autoregressive import Autoregressive
from .base import Agree, DecodeContext, Decoder, Step, Strategy, single_process
from .stats import GenerationStats


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that shapes a generation besides its prompt, validated on construction.

    stop: stop strings, applied by the text layer (a single string is one stop string, not its characters).
    """

    strategy: Strategy = field(default_factory=Autoregressive)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            raise ValueError(f"strategy must be a Strategy (Autoregressive(), Lookahead(...), Auto(...)) or its "
                             f"name, got {self.strategy!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (a whole number), got {self.max_new_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)


@dataclass
class TokenRun:
    """Outcome of decode_tokens: filled in as tokens are consumed."""

    stats: GenerationStats
    finish_reason: str = ""  # "eos", "length", "context" (or "stop", set by the text layer)


def check_prompt(prompt: Sequence[int], model: Transformer) -> None:
    """The prompt's ids fit the model: not empty, shorter than the context, inside the vocabulary."""
    config = model.config
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= config.max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens but the model's context is {config.max_seq_len} "
                         f"tokens; shorten the prompt")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is not an id of the vocabulary (0..{config.vocab_size - 1})")


def fitted_strategy(model: Transformer, prompt_len: int, settings: GenerationSettings) -> Strategy:
    """The settings' strategy with its steps fitted to the context left after the prompt (Strategy.fit)."""
    context = model.config.max_seq_len
    return settings.strategy.fit(context, max(1, context - prompt_len))


def cache_for(model: Transformer, prompt_len: int, settings: GenerationSettings,
              cache: KVCache | None = None, kept: int = 0) -> KVCache:
    """A KV cache for one generation: `cache` when it is large enough and of the kind and dtype the strategy's
    steps read (Strategy.cache_type, model.cache_dtype), else a new one. It needs every position the generation may
    use plus room for one step's speculative rows. kept: how many of `cache`'s committed rows to keep, the K/V of
    the prompt's first tokens (a prefix computed before: LLM); copied into a new cache of the same kind, dropped
    where the kind changes. The cache returned holds them committed, and nothing else."""
    strategy = fitted_strategy(model, prompt_len, settings)
    needed = min(model.config.max_seq_len, prompt_len + settings.max_new_tokens) + strategy.max_step_tokens()
    cache_type = strategy.cache_type(model)
    same_kind = cache is not None and type(cache) is cache_type and cache.dtype == model.cache_dtype
    if same_kind and cache.capacity >= needed:
        cache.truncate(kept)
        return cache
    new = model.new_cache(needed, cache_type=cache_type)
    if same_kind and kept:
        new.k[:, :, :, :kept] = cache.k[:, :, :, :kept]
        new.v[:, :, :, :kept] = cache.v[:, :, :, :kept]
        new.commit(kept)
    return new


def decode_tokens(model: Transformer, prompt: Sequence[int], run: TokenRun, settings: GenerationSettings, *,
                  eos_ids: Sequence[int] = (), cache: KVCache | None = None, kept: int = 0,
                  agree: Agree = single_process) -> Iterator[int]:
    """New token ids, one at a time, until EOS (yielded, then stop), max_new_tokens or the context is full.

    The prompt is checked and the decoder made now; the model runs as the iterator is consumed. The consumer may
    stop early (a stop string); run.stats then counts only the tokens it took. `cache` is used when large enough
    (see cache_for); nothing else may use it until the iterator is exhausted or closed. kept: how many of the
    cache's committed rows are the K/V of the prompt's first tokens, with the bits a prefill gives them
    (text_stream.reusable_rows), so that the prefill starts after them (fewer than the prompt's tokens: the last
    one's logits are computed). `agree`: rank 0's value of what it is given, for a sharded model
    (DecodeContext.agree).
    """
    check_prompt(prompt, model)
    if not 0 <= kept < len(prompt):
        raise ValueError(f"kept rows ({kept}) must be fewer than the prompt's {len(prompt)} tokens")
    sampler = Sampler(seeded(settings.sampling, agree), model.device, prompt,  # one seed on every rank
                      model.config.vocab_size)
    ctx = DecodeContext(model, cache_for(model, len(prompt), settings, cache, kept), sampler, list(prompt),
                        model.config.max_seq_len, agree)
    run.stats.strategy, run.stats.prompt_tokens = settings.strategy.name, len(prompt)
    run.stats.kept_tokens = ctx.cache.length
    with torch.inference_mode():
        decoder = fitted_strategy(model, len(prompt), settings).make_decoder(ctx)
    return _run_decoder(decoder, run, settings.max_new_tokens, frozenset(eos_ids))


def _run_decoder(decoder: Decoder, run: TokenRun, max_new_tokens: int, eos: frozenset[int]) -> Iterator[int]:
    """The loop: prefill, then steps, handing out their tokens one at a time and deciding where to stop.
    Inference mode is entered around each forward pass only, so the consumer's code never runs in it."""
    stats = run.stats
    limit = min(decoder.ctx.limit, stats.prompt_tokens + max_new_tokens)
    try:
        step, stats.prefill_s = timed(decoder.prefill)
        while True:
            for token in step.tokens:
                stats.new_tokens += 1
                if token in eos:
                    run.finish_reason = "eos"
                elif stats.new_tokens >= max_new_tokens:
                    run.finish_reason = "length"
                elif stats.prompt_tokens + stats.new_tokens >= limit:
                    run.finish_reason = "context"
                yield token  # the reason is set first, so a consumer that stops at this token sees it
                if run.finish_reason:
                    return
            step, seconds = timed(decoder.step)
            stats.count(step, seconds)
    finally:
        decoder.finish(stats.new_tokens)


def timed(forward: Callable[[], Step]) -> tuple[Step, float]:
    """Run one forward pass of a decoder (its prefill or a step) in inference mode; also return its seconds.
    The pass and its host work run from a fresh chunk of the frame stack, so their speed does not depend on the
    consumer's depth (frame_stack.py)."""
    start = time.perf_counter()
    with torch.inference_mode():
        step = on_fresh_frame_chunk(forward)
    return step, time.perf_counter() - start
