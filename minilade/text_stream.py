"""The text of one generation: streamed a piece at a time, never a broken character nor a piece of a stop string,
and its result (Generation). A stream runs on its LLM's spare KV cache and gives it back with the K/V its prompt and
answer left, which the next generation whose prompt begins with the same tokens reads from (a chat's next turn).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from .decoding import GenerationSettings, GenerationStats, TokenRun, decode_tokens
from .decoding.loop import cache_for
from .invariance import ExactAttention
from .memory import peak_memory
from .parallel import from_rank0
from .tokenizer import StreamDecoder
from .verify import common_prefix

if TYPE_CHECKING:
    from .llm import LLM
    from .model import Transformer


def splits_exactly(model: Transformer) -> bool:
    """True where a prompt's K/V and logits do not depend on how it is split between passes: the exact attention,
    which runs every row of a prefill through the invariant kernel (a prompt may then start from kept rows)."""
    return isinstance(model.attention_kernel, ExactAttention)


def reusable_rows(model: Transformer, prompt_len: int, committed: int) -> int:
    """How many of a finished generation's first `committed` cache rows (its prompt, then its answer) hold the bits
    a later prompt's prefill computes for the same tokens, so that a prompt beginning with those tokens may start
    from them: every row where one kernel writes a prompt's rows and an answer's (the exact attention eagerly, or a
    step runner that runs prefills too: native steps); only the prompt's under compiled steps, whose graphs round
    differently from the eager prefill that reads prompts; none where a prompt's bits depend on its split."""
    if not splits_exactly(model):
        return 0
    runner = model.step_runner
    return committed if runner is None or runner.runs_prefill else min(prompt_len, committed)


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # the new tokens (an EOS token that ended the generation included)
    prompt_ids: list[int]
    finish_reason: str    # "eos", "stop", "length" or "context"
    stats: GenerationStats = field(default_factory=GenerationStats)
    peak_memory: int | None = None  # bytes: the process's peak resident memory up to the end (peak_memory())

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_ids),
                "finish_reason": self.finish_reason, "stats": self.stats.as_dict(),
                "peak_memory_mib": None if self.peak_memory is None else round(self.peak_memory / 2**20, 1)}



class TextStream:
    """Streams the text of one generation: never a broken character, never a piece of a stop string.

    It holds the LLM's KV cache from creation until it is exhausted or closed; a generation started meanwhile
    gets a cache of its own, so streams never disturb each other. The cache comes back with the K/V of the prompt
    and answer, and the next generation whose prompt begins with the same tokens (a chat's next turn resends the
    conversation) reads only the rest of its prompt: the same bits, so the same answer, as reading all of it.
    """

    def __init__(self, llm: LLM, prompt_ids: list[int], settings: GenerationSettings) -> None:
        self.llm, self.prompt_ids, self.stop = llm, prompt_ids, settings.stop
        self.result: Generation | None = None
        self._run = TokenRun(GenerationStats())
        spare, spare_ids = llm._take_cache()
        kept = max(0, min(common_prefix(spare_ids, prompt_ids), len(prompt_ids) - 1))
        self._cache = cache_for(llm.model, len(prompt_ids), settings, spare, kept)
        self._tokens = decode_tokens(llm.model, prompt_ids, self._run, settings, eos_ids=llm.tokenizer.eos_ids,
                                     cache=self._cache, kept=self._cache.length,
                                     agree=functools.partial(from_rank0, llm.model))

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._pieces()
        finally:
            self._tokens.close()
            ids = self.prompt_ids + (self.result.token_ids if self.result is not None else [])
            kept = reusable_rows(self.llm.model, len(self.prompt_ids), min(len(ids), self._cache.length))
            self.llm._give_back_cache(self._cache, tuple(ids[:kept]))

    def _pieces(self) -> Iterator[str]:
        detok = StreamDecoder(self.llm.tokenizer, skip_special=True)
        eos = set(self.llm.tokenizer.eos_ids)
        longest_stop = max((len(s) for s in self.stop), default=0)
        ids: list[int] = []
        text, shown = "", 0
        for token in self._tokens:
            ids.append(token)
            if token in eos:
                break
            searched = max(0, len(text) - longest_stop + 1)
            text += detok.push([token])
            cut = find_stop(text, self.stop, searched)
            if cut is not None:
                text = text[:cut]
                self._run.finish_reason = "stop"
                break
            safe = len(text) - held_back(text, self.stop)
            if safe > shown:
                yield text[shown:safe]
                shown = safe
        if self._run.finish_reason != "stop":
            text += detok.finish()
        if len(text) > shown:
            yield text[shown:]
        self.result = Generation(text, ids, self.prompt_ids, self._run.finish_reason, self._run.stats,
                                 peak_memory())


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index where the earliest stop string begins in text[start:] (as an index into text), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of text that could still grow into a stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
