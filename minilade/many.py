"""Many prompts at once (LLM.generate_many): their generations share each forward pass on the server's engine
(serve/engine.py), whose loop runs in the caller's thread, so that the passes use that thread's OpenMP pool rather
than open a second one (the loading thread's, where the caller loaded the model). Each answer is the one its prompt
gets alone, as in the server. A prompt that begins with what a finished generation of the call read and wrote (a
shared system prompt or instructions) starts from its rows, as a server's request does (serve/prefill.py), within
KEPT_BYTES."""

from __future__ import annotations

import functools
import sys
import threading
from typing import Callable

from tqdm import tqdm

from .decoding import GenerationSettings
from .llm import LLM
from .serve.engine import Engine, Job
from .serve.prefill import PrefixCache
from .text_stream import Generation

KEPT_BYTES = 64 << 20  # finished generations' K/V kept for the call's later prompts that begin with them


def answer_all(llm: LLM, requests: list[tuple[list[int], GenerationSettings]], concurrency: int,
               progress: bool = False, on_done: Callable[[int, Generation], None] | None = None) -> list[Generation]:
    """Every request, (prompt ids, settings), answered on an engine whose loop runs in this thread (Engine.drain), up
    to `concurrency` at a time: their Generations in order (LLM.generate_many). A generation that fails ends the
    others and its error is raised; an interrupt cancels the running ones, winds their workers down and reaches the
    caller. progress: a bar on stderr counting the finished generations. on_done(index, generation): called as each
    finishes, from its worker thread, one call at a time."""
    finished = threading.Lock()
    engine = Engine(llm, max_concurrent=concurrency, queue_size=len(requests), prefixes=PrefixCache(KEPT_BYTES))
    ended: list[tuple[str, object] | None] = [None] * len(requests)
    jobs: list[Job] = []
    bar = tqdm(total=len(requests), desc="generations", unit="prompt", disable=not progress, file=sys.stderr)

    def deliver(i: int, kind: str, value: object) -> None:  # from the job's worker thread
        if kind == "piece":
            return
        ended[i] = (kind, value)
        bar.update()
        if kind == "done" and on_done is not None:
            with finished:
                on_done(i, value)
        if kind == "error":
            for job in jobs:
                engine.cancel(job)

    for i, (prompt_ids, settings) in enumerate(requests):
        jobs.append(Job(prompt_ids, settings, functools.partial(deliver, i)))
        engine.submit(jobs[-1])
    try:
        engine.drain()
    except BaseException:  # an interrupt in this thread: the workers are cancelled and wound down
        engine.stop()
        engine.drain()
        raise
    finally:
        bar.close()
    error = next((value for kind, value in filter(None, ended) if kind == "error"), None)
    if error is not None:
        raise error
    return [value for _, value in ended]
