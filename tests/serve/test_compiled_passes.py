"""A server over a model whose decoding steps are compiled: each call runs as the model runs it alone (a decoding
step with its compiled step's bits, alone or in a shared compiled pass; a prompt's prefill and its parts through the
eager layers), so each answer is the one LLM.generate gives with the same compiled model."""

from __future__ import annotations

import queue

import pytest
import torch

from minilade import LLM
from minilade.decoding import GenerationSettings, make_strategy
from minilade.masks import interleaved_step
from minilade.sampling import SamplingParams
from minilade.serve import compiled_pass
from minilade.serve.batched import ForwardCall, batched_forward, prepare_call, runs_compiled
from minilade.serve.cache_pool import CachePool
from minilade.serve.compiled_pass import GROUP, SharedPasses, groups
from minilade.serve.engine import Engine, Job
from minilade.serve.prefill import PrefixCache
from tests.helpers import FLAT_COSTS, assert_next_turns_answer_as_alone

from .test_engine import outcome

# Compiled graphs live in the process that made them: one worker compiles this model's, once.
pytestmark = pytest.mark.xdist_group("compiled")


@pytest.fixture(scope="module")
def llm(tiny_ckpt, kept_tables) -> LLM:
    llm = LLM.load(tiny_ckpt, dtype="float32", progress=False, compile=True)
    assert llm.model.step_runner is not None, llm.setup
    return llm


def test_a_pass_gives_each_call_the_logits_of_the_model_alone(llm):
    """A decoding call through the compiled step and a prefill's later part through the eager layers, in one pass:
    each bitwise what the model alone gives it (and the two ways of running a step do differ here, so the routing
    is what the equality checks)."""
    model = llm.model
    with torch.inference_mode():
        decoding, prefill = model.new_cache(64), model.new_cache(64)
        model(torch.arange(3, 12)[None], torch.arange(9), decoding)
        decoding.commit(9)
        model(torch.arange(20, 26)[None], torch.arange(6), prefill)
        prefill.length = 6  # the first part of a prompt read; the next part follows at rows [6, 10)
        calls = [ForwardCall(torch.tensor([[5, 6, 7]]), torch.arange(9, 12), decoding, None),
                 ForwardCall(torch.arange(26, 30)[None], torch.arange(6, 10), prefill, None, torch.tensor([3]),
                             prefill_part=True)]
        assert [runs_compiled(model, call) for call in calls] == [True, False]
        together = batched_forward(model, [prepare_call(model, call) for call in calls])
        compiled_alone = model(calls[0].tokens, calls[0].input_pos, decoding)
        runner, model.step_runner = model.step_runner, None
        try:
            eager = [model(call.tokens, call.input_pos, call.cache, None, call.logits_rows) for call in calls]
        finally:
            model.step_runner = runner
    assert torch.equal(together[0], compiled_alone) and torch.equal(together[1], eager[1])
    assert not torch.equal(compiled_alone, eager[0])


def test_a_shared_compiled_pass_gives_each_call_its_own_steps_logits(llm):
    """SharedPasses: the engine's check holds on this model, and a pass of three one-row calls and two
    lookahead-shaped ones over caches of different lengths gives each call bitwise what its own compiled step gives
    it, and writes the same rows into its cache (the rows past them are scratch: in the pool, what an earlier
    generation left there)."""
    model = llm.model
    passes = SharedPasses.checked(model)
    assert passes is not None
    with torch.inference_mode():
        calls = [[], []]  # the same calls over two copies of their caches
        for i, (past, rows) in enumerate([(5, 1), (17, 1), (40, 1), (9, 7), (23, 5)]):
            positions, mask = interleaved_step(past, rows, lanes=2) if rows > 1 else (torch.tensor([past]), None)
            for copy in calls:
                cache = model.new_cache(64)
                model(torch.arange(3, 3 + past)[None] % 40, torch.arange(past), cache)
                cache.commit(past)
                copy.append(ForwardCall(torch.arange(rows)[None] + i, positions, cache, mask))
        together = passes(model, calls[0])
        alone = [model(c.tokens, c.input_pos, c.cache, c.mask) for c in calls[1]]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    ends = [c.cache.length + c.tokens.shape[1] for c in calls[0]]
    assert all(torch.equal(a.cache.k[:, :, :, :end], b.cache.k[:, :, :, :end]) and
               torch.equal(a.cache.v[:, :, :, :end], b.cache.v[:, :, :, :end]) for a, b, end in zip(*calls, ends))
    for call in calls[0]:
        passes.release(call.cache)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_graph_that_refuses_a_pass_leaves_its_calls_to_their_own_steps(llm, monkeypatch, capsys, rows):
    """Where a kind's graph refuses a pass (its guards), the pass's calls run one after another with their own
    steps' logits, with a line saying so, and later passes of that kind go that way at once: the pool's graph (one-row
    calls) and a group's (wider calls)."""
    model = llm.model
    passes = SharedPasses.checked(model)
    with torch.inference_mode():  # the mode the engine's passes run in, which a kind names
        graphs, kind = (passes.pool.graphs, passes.pool.kind()) if rows == 1 else (passes.graphs, passes.kind(2))

    def refusing(*args):
        raise RuntimeError("GuardManager check failed, reason: a test's")
    monkeypatch.setitem(graphs.graphs, kind, refusing)
    with torch.inference_mode():
        calls = [[], []]
        for i, past in enumerate((6, 30)):
            positions, mask = interleaved_step(past, rows, lanes=2) if rows > 1 else (torch.tensor([past]), None)
            for copy in calls:
                cache = model.new_cache(64)
                model(torch.arange(3, 3 + past)[None] % 40, torch.arange(past), cache)
                cache.commit(past)
                copy.append(ForwardCall(torch.arange(rows)[None] + 5 + i, positions, cache, mask))
        got = passes.run_group(model, calls[0])
        want = [model(c.tokens, c.input_pos, c.cache, c.mask) for c in calls[1]]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert "refuses a pass" in capsys.readouterr().err and kind in passes.refused


def test_pooled_generations_decode_as_alone_while_the_pool_grows_and_slots_change_hands(llm):
    """Greedy one-row decoding of generations whose caches the pool adopts: a pass of two, then a third whose
    capacity makes the buffer grow (the held caches moved into the new one), then the first leaves and a fourth
    takes its slot. Every pass gives each call the logits of its own compiled step over a cache of its own."""
    model = llm.model
    assert SharedPasses.checked(model) is not None  # the pool's graph compiled and checked
    pool = CachePool(model)
    prompts = {"a": ([3, 4, 5], 40), "b": (list(range(6, 30)), 64), "c": (list(range(10, 17)), 300),
               "d": ([20, 21, 22, 23, 24], 80)}
    runs = {}  # name -> (pooled cache, own cache, last token)
    with torch.inference_mode():
        def start(name):
            ids, capacity = prompts[name]
            caches = []
            for _ in range(2):
                cache = model.new_cache(capacity)
                logits = model(torch.tensor([ids]), torch.arange(len(ids)), cache)
                cache.commit(len(ids))
                caches.append(cache)
            runs[name] = [*caches, int(logits[0, -1].argmax())]

        def step(names):
            calls = [ForwardCall(torch.tensor([[runs[n][2]]]), torch.tensor([runs[n][0].length]), runs[n][0])
                     for n in names]
            got = pool.run(calls)
            for name, logits in zip(names, got):
                pooled, own, token = runs[name]
                alone = model(torch.tensor([[token]]), torch.tensor([own.length]), own)
                assert torch.equal(logits, alone), name
                pooled.commit(1)
                own.commit(1)
                runs[name][2] = int(alone[0, -1].argmax())

        start("a"), start("b")
        for _ in range(3):
            step(["a", "b"])
        before = pool.buffer.k.shape
        start("c")
        for _ in range(3):
            step(["b", "a", "c"])
        assert pool.buffer.k.shape[1] > before[1] and pool.buffer.k.shape[3] > before[3]  # grown
        def same_rows(name):
            pooled, own, _ = runs[name]
            end = own.length
            return torch.equal(pooled.k[:, :, :, :end], own.k[:, :, :, :end]) and torch.equal(
                pooled.v[:, :, :, :end], own.v[:, :, :, :end])

        assert same_rows("a")
        slot_a = pool.slot_of(runs["a"][0])
        pool.release(runs["a"][0])
        start("d")
        for _ in range(3):
            step(["c", "d", "b"])
        assert pool.slot_of(runs["d"][0]) == slot_a
        assert all(same_rows(name) for name in "bcd")
        for name in "bcd":
            pool.release(runs[name][0])
        assert pool.buffer is None  # its memory freed once no slot is held


def test_a_models_check_runs_once_and_each_engine_gets_passes_of_its_own(llm, monkeypatch):
    """Every engine asks for shared passes (each LLM.generate_many makes one), and the check's probes, graph loads and
    measurements cost some 20 s for the demo model: after the first, the model is not probed again, and each caller
    gets passes with the checked graphs and measured costs and a cache pool of its own."""
    first = SharedPasses.checked(llm.model)
    monkeypatch.setattr(compiled_pass, "probe_calls", lambda *args: pytest.fail("the model was probed again"))
    monkeypatch.setattr(compiled_pass, "measure_passes", lambda *args: pytest.fail("the passes were measured again"))
    second = SharedPasses.checked(llm.model)
    assert second is not first and second.pool is not first.pool
    assert second.graphs is first.graphs and second.pool.graphs is first.pool.graphs
    assert (second.pool_costs, second.group_share) == (first.pool_costs, first.group_share)


def test_a_context_too_short_for_the_probes_leaves_compiled_calls_one_after_another(llm, monkeypatch, capsys):
    """Graphs of groups of GROUP calls are traced from probe calls over prompts of unequal lengths; a model whose
    context cannot hold them gets no shared compiled passes, with a line saying why (here: groups of 8 calls against
    the tiny model's 512 positions)."""
    monkeypatch.setattr(compiled_pass, "GROUP", 8)
    assert compiled_pass.probe_positions(8, 3) > llm.model.config.max_seq_len
    assert SharedPasses.checked(llm.model, max_calls=8) is None
    assert "cannot hold the probe calls" in capsys.readouterr().err


def test_the_cost_of_a_compiled_pass_is_the_pools_and_each_group_of_wider_calls(llm):
    """Planning a compiled pass: where two one-row calls or more share the pool's pass, every generation costs a slot
    of it (measured at the check, in one-row steps), a lone one-row call its own step; the wider calls their steps on
    top, but in a group only the dearest at its full cost (the others a measured share of their own steps); the
    parts of prompts one eager pass of all their rows; a generation alone its own step."""
    passes = SharedPasses.checked(llm.model)
    (base, per_call), share = passes.pool_costs, passes.group_share
    # The measured figures are only held to their clamps here: how they compare (a pass of four dearer than one of
    # two, a group cheaper than its calls one after another) is a timing, which a machine running the other test
    # worker can reverse; docs/serve.md gives them as measured.
    assert base >= 0 and per_call >= 0 and 0 <= share <= 1
    passes.pool_costs, passes.group_share = (0.5, 0.25), 0.5
    step = {1: 2.0, 4: 3.0, 8: 5.0, 32: 9.0, 64: 15.0}.__getitem__  # seconds of one call's step by rows
    assert passes.pass_cost([], [], step)(1) == 2.0 and passes.pass_cost([], [], step)(4) == 3.0
    pool = 2.0 * (0.5 + 0.25 * 4)
    assert passes.pass_cost([1, 1, 8], [], step)(1) == pytest.approx(pool + 5.0)
    assert passes.pass_cost([1, 1, 8], [], step)(4) == pytest.approx(pool + 5.0 + 0.5 * 3.0)
    assert passes.pass_cost([1, 8], [], step)(4) == pytest.approx(2.0 + 5.0 + 0.5 * 3.0)  # a lone one-row call
    assert passes.pass_cost([8], [], step)(4) == pytest.approx(5.0 + 0.5 * 3.0)  # no one-row call: no pool pass
    assert passes.pass_cost([8, 8, 8, 8], [], step)(1) == pytest.approx(2.0 + 5.0 + 0.5 * 15.0)
    assert passes.pass_cost([8, 8, 8, 8], [], step)(4) == pytest.approx(5.0 + 0.5 * 15.0 + 3.0)  # a group of its own
    assert passes.pass_cost([1], [32, 32], step)(1) == pytest.approx(15.0 + 2.0 * (0.5 + 0.25 * 2))


def test_a_pass_groups_calls_of_one_kind():
    """Every one-row call in the pool's pass, wider calls in groups of at most GROUP."""
    assert groups([1, 4, 1, 1, 3, 1, 1, 1]) == [[0, 2, 3, 5, 6, 7], [1, 4]]
    assert groups([2] * 9) == [list(range(GROUP)), list(range(GROUP, 2 * GROUP)), [8]]
    assert groups([2] * 5, largest=2) == [[0, 1], [2, 3], [4]]


def test_passes_for_fewer_generations_compile_no_larger_groups(llm):
    """A server that runs at most two generations at once has groups of two wider calls at most: it asks for no
    graph of larger groups (each kind takes some 10-25 s to compile for the demo model) and plans with groups of
    two; one that runs one generation at a time shares no pass."""
    passes = SharedPasses.checked(llm.model, max_calls=2)
    assert passes.kinds() == [SharedPasses.kind(2)]
    assert passes.groups([2, 3, 2, 1]) == [[3], [0, 1], [2]]
    passes.group_share = 0.5
    step = {1: 2.0, 4: 3.0, 8: 5.0}.__getitem__
    assert passes.pass_cost([8, 8], [], step)(4) == pytest.approx(5.0 + 0.5 * 5.0 + 3.0)  # a group of its own
    assert SharedPasses.checked(llm.model, max_calls=1) is None


def test_concurrent_answers_equal_alone_through_compiled_steps(llm):
    """Greedy auto, lookahead and plain decoding and a seeded sampled request, served together with a long prompt
    read in parts from a kept prefix: every answer is LLM.generate's through the same compiled steps."""
    served_answers_equal_alone(llm, SharedPasses)


def test_a_next_turn_starts_from_kept_rows_with_a_prefills_bits(llm):
    """A finished request's rows kept for the prompts that begin with them hold what a prefill of the same tokens
    writes: under compiled steps its prompt's rows only (its answer's were written by the graphs, which round
    otherwise than the eager prefill that reads prompts). The next turn, which resends the answer, answers as alone."""
    prefixes = PrefixCache(1 << 24)
    engine = Engine(llm, max_concurrent=2, prefixes=prefixes)
    engine.start()
    first_prompt = [(5 * i) % 37 + 2 for i in range(20)]
    settings = GenerationSettings(make_strategy("autoregressive"), max_new_tokens=12)
    try:
        first, events = make_job(first_prompt, settings)
        engine.submit(first)
        kind, answer = outcome(events)
        assert kind == "done" and len(answer.token_ids) == 12
        next_prompt = first_prompt + answer.token_ids + [3, 4, 5]
        second, events = make_job(next_prompt, settings)
        engine.submit(second)
        kind, reply = outcome(events)
    finally:
        engine.stop()
    assert kind == "done" and second.cached_tokens == len(first_prompt)
    kept = prefixes.find(next_prompt).kept
    n = len(kept.ids)
    cache = llm.model.new_cache(n + 4)
    with torch.inference_mode():
        llm.model(torch.tensor([list(kept.ids)]), torch.arange(n), cache)
    assert torch.equal(cache.k[:, :, :, :n], kept.k) and torch.equal(cache.v[:, :, :, :n], kept.v)
    assert reply.token_ids == llm.generate(next_prompt, max_new_tokens=12, strategy="autoregressive").token_ids


def test_a_next_turn_through_compiled_steps_starts_from_the_last_prompts_rows(llm):
    """LLM.generate under compiled steps: a prompt that resends the last prompt and answer starts from the last
    prompt's rows only (its answer's were written by the graphs) and gets the answer and K/V it gets alone."""
    assert_next_turns_answer_as_alone(llm, [(3 * i) % 29 + 2 for i in range(20)], [4, 5, 6], answer_kept=False)


def served_answers_equal_alone(llm: LLM, passes: type) -> None:
    """Serve greedy auto, lookahead and plain decoding and a seeded sampled request together, with a long prompt read
    in parts from a kept prefix, through an engine whose shared passes are of the type `passes`; assert that every
    answer is the one LLM.generate gives alone."""
    engine = Engine(llm, max_concurrent=4, prefixes=PrefixCache(1 << 24), prefill_chunk=8)
    assert isinstance(engine.shared_passes, passes)
    engine.start()
    prompt = [(7 * i) % 40 + 3 for i in range(40)]
    cases = [(prompt, "auto", SamplingParams()), ([5, 6, 7, 8] * 3, "lookahead", SamplingParams()),
             ([9, 10, 11], "autoregressive", SamplingParams()),
             ([12, 13, 14, 15], "auto", SamplingParams(temperature=0.9, top_p=0.9, seed=3))]
    try:
        first, first_events = make_job(prompt[:30], GenerationSettings(make_strategy("auto", costs=FLAT_COSTS),
                                                                       max_new_tokens=8))
        engine.submit(first)
        assert outcome(first_events)[0] == "done"  # its rows kept: the long prompt begins with them
        events = []
        for ids, strategy, sampling in cases:
            settings = GenerationSettings(make_strategy(strategy, costs=FLAT_COSTS), sampling, max_new_tokens=24)
            job, queue = make_job(ids, settings)
            engine.submit(job)
            events.append((job, queue, settings))
        got = [(job, outcome(queue)) for job, queue, _ in events]
    finally:
        engine.stop()
    assert any(job.cached_tokens for job, _ in got), "no prompt began from kept rows"
    for (ids, _, _), (_, _, settings), (_, (kind, generation)) in zip(cases, events, got):
        assert kind == "done"
        sampling = settings.sampling
        alone = llm.generate(ids, max_new_tokens=24, strategy=settings.strategy, temperature=sampling.temperature,
                             top_p=sampling.top_p, seed=sampling.seed)
        assert generation.token_ids == alone.token_ids, (ids, settings.strategy)


def make_job(ids: list[int], settings: GenerationSettings) -> tuple[Job, queue.Queue]:
    events: queue.Queue = queue.Queue()
    return Job(ids, settings, lambda kind, value: events.put((kind, value))), events
