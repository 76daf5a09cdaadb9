"""The generation loop, written once for every strategy: prefill, steps, budget, EOS, statistics.

decode_tokens() runs any Strategy on token ids and yields the new tokens one at a time; the text layer
(minilade/llm.py) adds tokenization, streaming and stop strings on top. GenerationSettings is the one place a
generation's settings are checked, before any model runs.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator, Sequence

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from ..sampling import Sampler, SamplingParams, seeded
from .autoregressive import Autoregressive
from .base import Agree, DecodeContext, Decoder, Step, Strategy, single_process


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
    step_kinds: Counter = field(default_factory=Counter)  # StepKind -> steps of that kind
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

    def count(self, step: Step, seconds: float) -> None:
        """Add one decoding step (not the prefill)."""
        self.decode_s += seconds
        self.steps += 1
        self.tokens_per_step[len(step.tokens)] += 1
        self.step_kinds[step.kind] += 1
        self.tokens_fed += step.fed

    def summary(self) -> str:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.tokens_per_step.items()))
        kinds = ", ".join(f"{k} x{v}" for k, v in self.step_kinds.most_common()) if len(self.step_kinds) > 1 else ""
        return (f"[{self.strategy}] prompt {self.prompt_tokens} tok, new {self.new_tokens} tok in "
                f"{self.forward_passes} passes ({self.compression:.2f} tok/pass), "
                f"prefill {self.prefill_s * 1e3:.0f} ms, "
                f"decode {self.decode_s * 1e3:.0f} ms ({self.step_ms:.1f} ms/step), {self.tokens_per_s:.1f} tok/s"
                + (f", tokens/step histogram {hist}" if hist else "") + (f", steps: {kinds}" if kinds else ""))

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # asdict would turn StepKind keys into dicts
        d["tokens_per_step"] = {int(k): v for k, v in sorted(self.tokens_per_step.items())}
        d["step_kinds"] = {str(k): v for k, v in self.step_kinds.most_common()}
        d.update(forward_passes=self.forward_passes, compression=self.compression, tokens_per_s=self.tokens_per_s,
                 step_ms=self.step_ms, tokens_fed_per_step=self.tokens_fed_per_step)
        return d


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
              cache: KVCache | None = None) -> KVCache:
    """A KV cache for one generation: `cache` when it is large enough and of the kind the strategy's steps read
    (Strategy.cache_type), else a new one. It needs every position the generation may use plus room for one step's
    speculative rows."""
    strategy = fitted_strategy(model, prompt_len, settings)
    needed = min(model.config.max_seq_len, prompt_len + settings.max_new_tokens) + strategy.max_step_tokens()
    cache_type = strategy.cache_type(model)
    if cache is None or cache.capacity < needed or type(cache) is not cache_type:
        cache = model.new_cache(needed, cache_type=cache_type)
    cache.truncate(0)
    return cache


def decode_tokens(model: Transformer, prompt: Sequence[int], run: TokenRun, settings: GenerationSettings, *,
                  eos_ids: Sequence[int] = (), cache: KVCache | None = None,
                  agree: Agree = single_process) -> Iterator[int]:
    """New token ids, one at a time, until EOS (yielded, then stop), max_new_tokens or the context is full.

    The prompt is checked and the decoder made now; the model runs as the iterator is consumed. The consumer may
    stop early (a stop string); run.stats then counts only the tokens it took. `cache` is used when large enough
    (see cache_for); nothing else may use it until the iterator is exhausted or closed. `agree`: rank 0's value of
    what it is given, for a sharded model (DecodeContext.agree).
    """
    check_prompt(prompt, model)
    sampler = Sampler(seeded(settings.sampling, agree), model.device, prompt,  # one seed on every rank
                      model.config.vocab_size)
    ctx = DecodeContext(model, cache_for(model, len(prompt), settings, cache), sampler, list(prompt),
                        model.config.max_seq_len, agree)
    run.stats.strategy, run.stats.prompt_tokens = settings.strategy.name, len(prompt)
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
    """Run one forward pass of a decoder (its prefill or a step) in inference mode; also return its seconds."""
    start = time.perf_counter()
    with torch.inference_mode():
        step = forward()
    return step, time.perf_counter() - start
