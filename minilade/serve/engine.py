"""The engine: one thread schedules every forward pass over the model; each request's generation shares them.

Each admitted request runs the library's own generation (text_stream.TextStream: decode_tokens with any strategy, stop
strings, streaming text) in a worker thread of its own, against a `ModelProxy` instead of the model. The proxy does
not compute: a decoder's forward call is handed to the engine and the worker blocks until its logits come back. The
engine waits until every running request is blocked in a forward call (or has finished), then has one pass run over
all their rows (batched.batched_forward) and each call answered with its logits. The decoders are unchanged, and
each sees exactly the logits it would get alone, so each answer is the one it gets alone (where the model's steps
are native or compiled, its decoding calls go through native or compiled passes that give each call its own step's
bits). A prompt's
prefill starts from the rows kept for a prefix it shares with a finished request and runs in chunks (prefill.py).
The server runs the engine's loop in a thread of its own (start); the library's LLM.generate_many in the caller's
(drain).

Every pass runs in the engine's thread, on torch's CPU threads, and a worker computes on its own thread alone
(compute_alone): each thread that opens a parallel region gets an OpenMP pool of its own, and a
second pool slows every parallel operation (likely because libgomp spins idle threads only briefly once they
outnumber the cores, as its GOMP_SPINCOUNT documentation says, so each operation waits for its threads to wake).
Measured on 2 cores, a one-row step of the demo model:
compiled, 8.5 ms in the thread that loaded the model and 23 ms in a second thread; eager, 10.5 and 18 ms; with
everything in one thread, loading included, 10 ms whichever thread that is.

    HTTP (asyncio) --submit--> waiting (bounded) --admit--> running (<= max_concurrent worker threads)
                                                               | forward call, blocks
    engine thread: wait for every running worker's call -> one batched pass -> logits to each
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..decoding import GenerationSettings
from ..decoding.auto import Auto
from ..drafts.history import DraftHistory
from ..kv_cache import KVCache
from ..llm import LLM
from ..model import Transformer
from ..text_stream import TextStream, reusable_rows, splits_exactly
from .batched import ForwardCall, PreparedCall, batched_forward, prepare_call, runs_compiled
from .compiled_pass import SharedPasses
from .errors import busy, unavailable
from .metrics import Metrics
from .native_pass import NativePasses
from .planner import PassMember, PassPlans, rows_together
from .prefill import (
    PREFILL_ALONE,
    PREFILL_CHUNK,
    PREFILL_PER_REQUEST,
    Hit,
    PrefixCache,
    is_prefill,
    prefill_calls,
)

log = logging.getLogger("minilade.serve")


def compute_alone() -> None:
    """Run this thread's torch operations on this thread alone, opening no OpenMP pool (module docstring): its own
    OpenMP thread count set to 1 (omp_set_num_threads acts on the calling thread), torch.get_num_threads() left as it
    is everywhere else (torch.set_num_threads would change the count every thread starts with, and compiled graphs
    guard on it). Nothing is done where torch's OpenMP runtime is not found beside it."""
    torch.get_num_threads()  # torch sets a thread's count at its first parallel call: first, not after this
    for runtime in sorted((Path(torch.__file__).parent / "lib").glob("lib*omp*.so*")):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(str(runtime)).omp_set_num_threads(1)
            return


class Cancelled(Exception):
    """Raised inside a worker's forward call when its request was cancelled (client gone, server stopping)."""


@dataclass
class Job:
    """One request's generation. deliver(kind, value) is called from the worker thread with ("piece", text) as
    text streams, then once with ("done", Generation), ("cancelled", None) or ("error", exception)."""

    prompt_ids: list[int]
    settings: GenerationSettings
    deliver: Callable[[str, object], None]
    cancelled: bool = False
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class Signal:
    """Set once by one thread, waited for by another: a bare lock, held until set. A pass wakes every running
    request's worker; threading.Event would wake each through a Condition written in Python, under the GIL while
    the others wait (8 requests at a time in process, plain steps: +3% tokens/s with this, medians of 10
    alternated rounds, 9 of them faster)."""

    __slots__ = ("_held", "_set")

    def __init__(self) -> None:
        self._held, self._set = threading.Lock(), False
        self._held.acquire()

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._held.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self) -> None:
        """Block until set (for one waiter: the lock is not given back)."""
        self._held.acquire()


@dataclass(eq=False)
class PendingCall:
    """A worker's forward call waiting for the engine: answered with its logits or an error."""

    forward: ForwardCall
    done: Signal = field(default_factory=Signal)
    logits: torch.Tensor | None = None
    error: BaseException | None = None

    def answer(self, logits: torch.Tensor | None = None, error: BaseException | None = None) -> None:
        self.logits, self.error = logits, error
        self.done.set()


@dataclass(eq=False)
class Slot:
    """A running request: its job, its worker thread and the forward call it is blocked in (None while it works)."""

    job: Job
    member: PassMember  # its part in the planning of the shared passes
    thread: threading.Thread | None = None
    call: PendingCall | None = None
    hit: Hit | None = None  # kept rows its prefill starts from
    caches: list[KVCache] = field(default_factory=list)  # the caches its generation made (ModelProxy.new_cache)


class ModelProxy:
    """What a decoder sees as its model: the real model's config, device, dtype, attention kernel, step runner and
    caches, but a forward call goes to the engine (Transformer.forward's signature)."""

    def __init__(self, engine: Engine, slot: Slot) -> None:
        self._engine, self._slot, model = engine, slot, engine.llm.model
        self.config, self.attention_kernel, self.device, self.dtype = (model.config, model.attention_kernel,
                                                                        model.device, model.dtype)
        self.step_runner = model.step_runner
        self.cache_type, self.cache_dtype = model.cache_type, model.cache_dtype

    def new_cache(self, capacity: int | None = None, batch_size: int = 1, cache_type: type[KVCache] | None = None
                  ) -> KVCache:
        """As Transformer.new_cache; the rotary tables already cover the context (Engine.__init__)."""
        cache_type = cache_type or self.cache_type
        cache = cache_type(self.config, capacity or self.config.max_seq_len, batch_size=batch_size,
                           dtype=self.cache_dtype, device=self.device)
        self._slot.caches.append(cache)  # for the engine to release when the generation ends
        return cache

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache,
                 mask: torch.Tensor | None = None, logits_rows: torch.Tensor | None = None, *,
                 prefill: bool = False) -> torch.Tensor:
        """As Transformer.forward. A request's decoder starts from an empty cache, so its prefill is the call
        is_prefill knows by its shape, read here from the engine's kept rows and in chunks (prefill.py)."""
        call, slot = ForwardCall(tokens, input_pos, cache, mask, logits_rows), self._slot
        if not self._engine.split_prefills or not is_prefill(call, len(slot.job.prompt_ids)):
            return self._engine.forward(slot, call)
        # kept rows copied, the rest in chunks
        slot.job.cached_tokens, calls = prefill_calls(call, slot.hit, self._engine.prefill_rows)
        try:
            for part in calls:
                logits = self._engine.forward(slot, part)
            return logits
        finally:
            cache.length = 0  # the decoder commits the whole prompt itself


class Engine:
    """Runs the generations of up to max_concurrent requests together; up to queue_size more wait their turn."""

    def __init__(self, llm: LLM, *, max_concurrent: int = 8, queue_size: int = 32,
                 metrics: Metrics | None = None, prefixes: PrefixCache | None = None, plan_together: bool = True,
                 history: DraftHistory | None = None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        """prefixes: where finished requests' K/V are kept for the prompts that begin with them (None: nowhere).
        plan_together: greedy auto generations size their steps for the whole pass (planner.py), not alone.
        history: earlier answers that greedy auto generations draft from, and add theirs to (None: none shared).
        prefill_chunk: prompt rows a new request feeds each pass while others run, at least (prefill_rows)."""
        self.llm, self.max_concurrent, self.queue_size, self.prefixes = llm, max_concurrent, queue_size, prefixes
        # Where the model's steps are native or compiled, its decoding calls run in passes of their own
        # (native_pass.py, compiled_pass.py, where checked exact), whose cost their pass_cost says; else one after
        # another, and greedy auto generations plan as alone.
        self.shared_passes = NativePasses.checked(llm.model) or SharedPasses.checked(llm.model, max_concurrent)
        self.plan_together = plan_together and (llm.model.step_runner is None or self.shared_passes is not None)
        self.pass_cost = self.shared_passes.pass_cost if self.shared_passes is not None else rows_together
        self.sharing = self.shared_passes.what if self.shared_passes is not None else (  # for the user
            "eager passes" if llm.model.step_runner is None else "their own steps, one after another")
        self.history, self.plans = history, PassPlans()
        self.prefill_chunk = prefill_chunk
        self.split_prefills = splits_exactly(llm.model)  # from kept rows and in chunks (prefill.py)
        self.metrics = metrics or Metrics()
        self.metrics.gauges.update(minilade_requests_running=lambda: len(self._running),
                                   minilade_queue_depth=lambda: len(self._waiting))
        llm.model.cover_positions(llm.model.config.max_seq_len)  # the rotary tables never change while serving
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Slot] = []
        self._stopping = False
        self._draining = False  # the loop ends once every job submitted has ended (drain)
        self._thread = threading.Thread(target=self._loop, name="minilade-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def prefill_rows(self) -> int:
        """Prompt rows the next prefill pass takes: while other requests run and wait for it, PREFILL_PER_REQUEST for
        each running request and at least prefill_chunk (few rows hold up their next tokens least; each pass more
        costs their host work again, more of it the more they are: prefill.py); many while none runs
        (prefill.PREFILL_ALONE)."""
        running = len(self._running)
        return max(self.prefill_chunk, PREFILL_PER_REQUEST * running) if running > 1 else PREFILL_ALONE

    def drain(self) -> None:
        """Run the engine's loop in this thread, instead of start()'s thread of its own, until every job submitted
        has ended: the library's LLM.generate_many, whose passes then run in the caller's thread with its OpenMP
        pool (module docstring)."""
        with self._cond:
            self._draining = True
        self._loop()

    def submit(self, job: Job) -> None:
        """Queue a job; a 429 APIError when the queue is full, a 503 when the engine is stopping."""
        with self._cond:
            if self._stopping:
                raise unavailable("the server is shutting down")
            if len(self._running) + len(self._waiting) >= self.max_concurrent + self.queue_size:
                raise busy(f"all {self.max_concurrent} places are taken and {self.queue_size} requests wait; "
                           f"retry later")
            self._waiting.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Stop a job: dropped from the queue, or its worker's next forward call raises Cancelled (its rows and
        cache are freed at the next step). Nothing happens to a job that has finished."""
        with self._cond:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                job.deliver("cancelled", None)
            self._cond.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything still queued or running and wait (up to timeout seconds) for the engine to end."""
        with self._cond:
            self._stopping = True
            for job in list(self._waiting):
                job.deliver("cancelled", None)
            self._waiting.clear()
            for slot in self._running:
                slot.job.cancelled = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- worker side ------------------------------------------------------------------------------------------

    def forward(self, slot: Slot, call: ForwardCall) -> torch.Tensor:
        """Called by a worker (through its ModelProxy): hand the call to the engine and wait for its logits."""
        pending = PendingCall(call)
        with self._cond:
            if slot.job.cancelled:
                raise Cancelled()
            slot.call = pending
            self._cond.notify_all()
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.logits

    def _work(self, slot: Slot) -> None:
        """A worker thread: the request's whole generation, its text handed out as it streams."""
        job = slot.job
        compute_alone()
        try:
            if self.prefixes is not None and self.split_prefills:
                slot.hit = self.prefixes.find(job.prompt_ids)
            view = LLM(ModelProxy(self, slot), self.llm.tokenizer, self.llm.name, self.llm.generation_defaults)
            stream = TextStream(view, job.prompt_ids, self.pass_settings(job.settings, slot.member))
            for piece in stream:
                job.deliver("piece", piece)
            stream.result.stats.kept_tokens = job.cached_tokens  # read from the engine's kept rows
            self.metrics.generation(stream.result.stats)
            cache, _ = view._take_cache()  # given back by the finished stream
            if self.prefixes is not None and self.split_prefills and cache is not None:
                ids = job.prompt_ids + stream.result.token_ids
                self.prefixes.keep(ids[:reusable_rows(self.llm.model, len(job.prompt_ids), cache.length)], cache)
            job.deliver("done", stream.result)
        except Cancelled:
            self.metrics.add("minilade_requests_cancelled_total")
            job.deliver("cancelled", None)
        except Exception as error:  # noqa: BLE001 -- one request's failure is its own; the others go on
            if not isinstance(error, ValueError):
                log.exception("generation failed")
            job.deliver("error", error)
        finally:
            slot.member.leave()
            if self.shared_passes is not None:
                for cache in slot.caches:  # its place in the cache pool, for the next generation
                    self.shared_passes.release(cache)
            with self._cond:
                self._running.remove(slot)
                self._cond.notify_all()

    def pass_settings(self, settings: GenerationSettings, member: PassMember) -> GenerationSettings:
        """A greedy auto generation plans its steps for the whole pass and drafts from the shared history, where
        the engine has them; any other generation keeps the settings it has alone, because a sampled answer depends
        on its plans and drafts (verification draws more or fewer numbers) and a greedy one does not."""
        strategy = settings.strategy
        if not isinstance(strategy, Auto) or not settings.sampling.greedy:
            return settings
        shared = member if self.plan_together else None
        history = strategy.history if self.history is None else self.history
        return dataclasses.replace(settings, strategy=dataclasses.replace(strategy, shared=shared, history=history))

    # ---- engine side ------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._ready)
                if (self._stopping or self._draining) and not self._running and not self._waiting:
                    return
                self._admit()
                if not self._running or any(slot.call is None for slot in self._running):
                    continue  # the admitted workers have not asked for their first pass yet
                slots = list(self._running)
                calls = [slot.call for slot in slots]
                for slot in slots:
                    slot.call = None
            self._run_pass(slots, calls)

    def _ready(self) -> bool:
        """Something to do: every running worker waits in a forward call, or a queued job can be admitted, or the
        engine stops and nothing runs."""
        if self._stopping:
            return not self._running or all(slot.call is not None for slot in self._running)
        if self._draining and not self._running and not self._waiting:
            return True
        admissible = bool(self._waiting) and len(self._running) < self.max_concurrent
        blocked = bool(self._running) and all(slot.call is not None for slot in self._running)
        return admissible or blocked

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_concurrent and not self._stopping:
            slot = Slot(self._waiting.popleft(), PassMember(self.plans, self.pass_cost))
            slot.thread = threading.Thread(target=self._work, args=(slot,), name="minilade-request", daemon=True)
            self._running.append(slot)
            slot.thread.start()

    def _run_pass(self, slots: list[Slot], calls: list[PendingCall]) -> None:
        """The pass. Whatever escapes it reaches every call it leaves unanswered, so that no worker waits
        forever; an interrupt (in a loop drained in the caller's thread) cancels them and goes on to the caller."""
        try:
            self._step(slots, calls)
        except BaseException as error:  # noqa: BLE001
            interrupt = not isinstance(error, Exception)
            if not interrupt:
                log.exception("a pass failed")
            for call in calls:
                if not call.done.is_set():
                    call.answer(error=Cancelled() if interrupt else error)
            if interrupt:
                raise

    def _step(self, slots: list[Slot], calls: list[PendingCall]) -> None:
        """One shared forward pass over the calls of every running request; a call that cannot run (its request
        was cancelled, or its input is invalid) gets its error instead, without touching the others."""
        model = self.llm.model
        with torch.inference_mode():
            ready = []
            for slot, call in zip(slots, calls):
                if slot.job.cancelled:
                    call.answer(error=Cancelled())
                    continue
                try:
                    ready.append((call, prepare_call(model, call.forward)))
                except ValueError as error:
                    call.answer(error=error)
                    continue
                slot.member.fed(ready[-1][1].T, eager=not runs_compiled(model, call.forward))
            if not ready:
                return
            try:
                logits = batched_forward(model, [prepared for _, prepared in ready], self.shared_passes)
            except Exception:  # noqa: BLE001 -- never let one call's fault reach the others: run each alone
                log.exception("a shared pass failed; running its calls one by one")
                logits = [self._alone(model, prepared, call) for call, prepared in ready]
        # The passes that ran: one for all the eager calls, one for each group of compiled ones.
        kinds: tuple[list[int], list[int]] = ([], [])  # rows of the eager calls, of the compiled ones
        for _, prepared in ready:
            kinds[runs_compiled(model, prepared.call)].append(prepared.T)
        eager, steps = kinds
        if eager:
            self.metrics.forward_pass(len(eager), sum(eager))
        together = self.shared_passes.groups(steps) if self.shared_passes else [[i] for i in range(len(steps))]
        for group in together:
            self.metrics.forward_pass(len(group), sum(steps[i] for i in group))
        for (call, _), result in zip(ready, logits):
            if result is not None:
                call.answer(result)

    @staticmethod
    def _alone(model: Transformer, prepared: PreparedCall, call: PendingCall) -> torch.Tensor | None:
        """One call's logits from a pass of its own, or None when it fails too (the call then has its error)."""
        try:
            return batched_forward(model, [prepared])[0]
        except Exception as error:  # noqa: BLE001
            call.answer(error=error)
            return None
