"""The engine in this process: its bounded queue, one request's failure kept to itself, cancellation, and the
server's exit on SIGTERM with an answer in flight."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from minilade import LLM
from minilade.cli import console
from minilade.decoding import GenerationSettings, make_strategy
from minilade.drafts.history import DraftHistory
from minilade.sampling import SamplingParams
from minilade.serve.engine import Engine, Job, Signal, compute_alone
from minilade.serve.errors import APIError
from minilade.serve.planner import PassMember, PassPlans
from minilade.serve.prefill import PREFILL_ALONE
from tests.helpers import FLAT_COSTS

from .helpers import CONTEXT, free_port, start_server


@pytest.fixture(scope="module")
def llm(tiny_ckpt, kept_tables) -> LLM:
    return LLM.load(tiny_ckpt, dtype="float32", progress=False, compile=False)


def job(prompt: list[int], strategy: str = "autoregressive", max_new_tokens: int = 24) -> tuple[Job, queue.Queue]:
    events: queue.Queue = queue.Queue()
    settings = GenerationSettings(make_strategy(strategy, costs=FLAT_COSTS), max_new_tokens=max_new_tokens)
    return Job(prompt, settings, lambda kind, value: events.put((kind, value))), events


def outcome(events: queue.Queue) -> tuple[str, object]:
    while True:
        kind, value = events.get(timeout=60)
        if kind != "piece":
            return kind, value


def test_queue_full_is_429_with_retry_after(llm):
    engine = Engine(llm, max_concurrent=1, queue_size=2)  # not started: every job stays queued
    waiting = [job([5, 6, 7]) for _ in range(3)]  # a place and the queue's two
    for j, _ in waiting:
        engine.submit(j)
    with pytest.raises(APIError) as caught:
        engine.submit(job([5, 6, 7])[0])
    assert caught.value.status == 429 and caught.value.headers["Retry-After"]
    engine.stop()
    assert all(outcome(events)[0] == "cancelled" for _, events in waiting)
    with pytest.raises(APIError) as caught:
        engine.submit(job([5])[0])
    assert caught.value.status == 503


def test_a_failing_request_leaves_the_others_alone(llm):
    """A request whose generation fails (a token id outside the vocabulary, past the HTTP checks) gets its error;
    the requests beside it get their own answers, as alone."""
    engine = Engine(llm, max_concurrent=4, queue_size=4)
    engine.start()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    good = [job(p, strategy) for p, strategy in zip(prompts, ["autoregressive", "lookahead", "auto"])]
    bad, bad_events = job([5, llm.model.config.vocab_size + 3])
    for j, _ in good[:2] + [(bad, bad_events)] + good[2:]:
        engine.submit(j)
    kind, error = outcome(bad_events)
    assert kind == "error" and isinstance(error, ValueError)
    for prompt, (_, events) in zip(prompts, good):
        kind, generation = outcome(events)
        assert kind == "done"
        assert generation.token_ids == llm.generate(prompt, max_new_tokens=24, strategy="autoregressive").token_ids
    engine.stop()


def test_cancel_stops_a_running_generation(llm):
    engine = Engine(llm, max_concurrent=2, queue_size=2)
    engine.start()
    j, events = job([5, 6, 7], max_new_tokens=CONTEXT - 8)
    engine.submit(j)
    assert events.get(timeout=60)[0] == "piece"
    engine.cancel(j)
    kind, _ = outcome(events)
    assert kind in ("cancelled", "done")  # done only if it ended before the cancel was seen
    engine.stop()


def test_sigterm_lets_the_running_answer_finish_and_exits_0(tiny_ckpt):
    server = start_server(tiny_ckpt, "--shutdown-timeout", "20")
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "stream": True, "strategy": "autoregressive"}
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", content=json.dumps(body), timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    assert server.stop(timeout=60) == 0, server.output()
    reader.join(60)
    assert lines[-1] == "data: [DONE]", lines[-3:]  # finished within --shutdown-timeout, not cut


def test_a_checkpoint_that_does_not_load_ends_the_server_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "minilade.serve", "--ckpt", str(tmp_path / "missing.gguf"),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in done.stderr


def test_greedy_auto_plans_for_the_pass_and_a_sampled_request_keeps_its_own_plans(llm):
    history = DraftHistory()
    engine = Engine(llm, history=history)
    member = PassMember(engine.plans)
    greedy = GenerationSettings(make_strategy("auto", costs=FLAT_COSTS))
    strategy = engine.pass_settings(greedy, member).strategy
    assert strategy.shared is member and strategy.history is history
    sampled = GenerationSettings(make_strategy("auto", costs=FLAT_COSTS), SamplingParams(temperature=0.8, seed=1))
    plain = GenerationSettings(make_strategy("autoregressive"))
    assert engine.pass_settings(sampled, member) is sampled and engine.pass_settings(plain, member) is plain
    assert Engine(llm, plan_together=False).pass_settings(greedy, member).strategy.shared is None


def test_pass_plans_sum_what_the_others_feed():
    plans = PassPlans()
    a, b, c = PassMember(plans), PassMember(plans), PassMember(plans)
    a.fed(128, eager=True)  # a prefill chunk (or any call of a generation that does not plan): rows, tokens of work
    b.plan(6, 2.5)
    b.fed(6)  # b plans its own steps: what the engine ran does not replace what b expects of them
    def others(member):  # the pass's cost if the member feeds one row, under a step cost of one per row
        cost, tokens, all_plain = member.others(lambda rows: float(rows))
        assert all_plain == 1.0  # under one second a row, every generation plain: a token a second a row
        return cost(1), tokens
    assert others(c) == (135, 130.5) and others(a) == (7, 2.5) and others(b) == (129, 128)
    # the generations feeding the passes, each counting itself: c has fed nothing yet
    assert (a.generations(), b.generations(), c.generations()) == (2, 2, 3)
    a.leave()
    assert others(c) == (7, 2.5) and (b.generations(), c.generations()) == (1, 2)


def test_a_shared_history_and_pass_planning_leave_greedy_answers_alone(llm):
    """Two rounds of three greedy auto requests with a history shared across them (the second round drafts from
    the first's answers): every answer is the autoregressive one."""
    history = DraftHistory()
    engine = Engine(llm, max_concurrent=4, queue_size=4, history=history)
    engine.start()
    prompts = [[5, 6, 7, 8] * 3, [5, 6, 7, 8] * 3 + [9], [9, 10, 11] * 4]
    answered = 0
    for _ in range(2):
        jobs = [job(p, "auto") for p in prompts]
        for j, _ in jobs:
            engine.submit(j)
        for prompt, (_, events) in zip(prompts, jobs):
            kind, generation = outcome(events)
            assert kind == "done"
            assert generation.token_ids == llm.generate(prompt, max_new_tokens=24,
                                                        strategy="autoregressive").token_ids
            answered += len(generation.token_ids)
        assert len(history) == answered > 0  # every answer kept, for the next round to draft from
    engine.stop()


def test_the_minilade_command_serves(capsys):
    """`minilade serve ...` is the server's command line (here refusing a bad option before loading anything)."""
    with pytest.raises(SystemExit) as caught:
        console(["serve", "--max-concurrent", "0"])
    assert caught.value.code == 2 and "--max-concurrent must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("chunk, parts", [(4, [4, 4, 4, 4, 4]), (7, [7, 7, 6])])
def test_a_prompt_is_read_in_chunks_while_others_run_and_whole_alone(llm, chunk, parts):
    """--prefill-chunk: beside a running request, a prompt of 20 tokens feeds the passes `chunk` rows at a time;
    alone, in one pass (PREFILL_ALONE rows); either way the answer is the one a whole prefill gives."""
    engine = Engine(llm, prefill_chunk=chunk)
    fed = []  # (job, rows) of every forward call
    forward = engine.forward
    engine.forward = lambda slot, call: (fed.append((slot.job, call.tokens.shape[1])), forward(slot, call))[1]
    engine.start()
    prompt = [(7 * i) % 40 + 3 for i in range(20)]
    expected = llm.generate(prompt, max_new_tokens=3, temperature=0, strategy="autoregressive").token_ids

    alone, events = job(prompt, max_new_tokens=3)
    engine.submit(alone)
    assert outcome(events)[1].token_ids == expected
    running, running_events = job([5, 6, 7], max_new_tokens=64)
    engine.submit(running)
    assert running_events.get(timeout=60)[0] == "piece"  # it decodes while the next prompt is read
    beside, events = job(prompt, max_new_tokens=3)
    engine.submit(beside)
    assert outcome(events)[1].token_ids == expected
    outcome(running_events)
    engine.stop()
    assert [rows for j, rows in fed if j is alone and rows > 1] == [20]
    assert [rows for j, rows in fed if j is beside and rows > 1] == parts


def test_prompt_rows_a_pass_grow_with_the_running_requests(llm):
    """A prompt part takes PREFILL_PER_REQUEST rows for each running request, at least --prefill-chunk, while others
    run; PREFILL_ALONE while it runs alone."""
    engine = Engine(llm, prefill_chunk=8)
    rows = []
    for running in (1, 2, 4, 6, 8, 12):
        engine._running = [None] * running
        rows.append(engine.prefill_rows())
    assert rows == [PREFILL_ALONE, 8, 8, 12, 16, 24]


def test_a_signal_wakes_its_waiter_once_set():
    """PendingCall's signal: the waiting thread blocks until the engine sets it; setting it again changes nothing."""
    signal, woke = Signal(), []
    waiter = threading.Thread(target=lambda: (signal.wait(), woke.append(signal.is_set())))
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive() and not signal.is_set()
    signal.set()
    signal.set()
    waiter.join(10)
    assert woke == [True]


def test_a_worker_computes_on_its_own_thread_alone():
    """compute_alone: the calling thread's torch operations run on it alone (torch reports 1 thread there), while
    torch's thread count elsewhere, which compiled graphs guard on, stays as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        worker = threading.Thread(target=lambda: (compute_alone(), seen.append(torch.get_num_threads())))
        worker.start()
        worker.join()
        assert seen == [1] and torch.get_num_threads() == 2
        later = []
        other = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        other.start()
        other.join()
        assert later == [2]
    finally:
        torch.set_num_threads(before)
