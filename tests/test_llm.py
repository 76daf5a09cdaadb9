"""The library front door: prompts, settings, streams that share one LLM, and no state leaking to the caller."""

from __future__ import annotations

import copy
import threading
import warnings
from pathlib import Path

import pytest
import torch

from minilade import LLM, Lookahead
from minilade.model import PREFILL_ROWS

from .helpers import assert_next_turns_answer_as_alone, write_tiny_checkpoint

pytest.importorskip("transformers")

WORDS = "a b c d hello world the cat sat on the mat"


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), WORDS, max_positions=128, chat_template=template)
    return LLM.load(Path(folder), dtype="float32", device="cpu", progress=False, compile=False)


def test_streams_of_one_llm_do_not_disturb_each_other(llm: LLM) -> None:
    """Pausing one stream, running another generation, then resuming the first gives what it gives alone."""
    alone = llm.generate("a b c", max_new_tokens=24)
    other = llm.generate("hello world the", max_new_tokens=24)
    stream = llm.stream("a b c", max_new_tokens=24)
    pieces = iter(stream)
    started = [next(pieces), next(pieces)]
    assert llm.generate("hello world the", max_new_tokens=24).token_ids == other.token_ids
    rest = list(pieces)
    assert "".join(started + rest) == alone.text and stream.result.token_ids == alone.token_ids


def test_a_finished_stream_hands_its_cache_to_the_next(llm: LLM, monkeypatch) -> None:
    llm.generate("a b", max_new_tokens=4)
    made, new_cache = [], llm.model.new_cache
    monkeypatch.setattr(llm.model, "new_cache", lambda *args, **kwargs: made.append(args) or new_cache(*args, **kwargs))
    llm.generate("c d", max_new_tokens=4)
    assert made == []  # the finished generation's cache was taken again
    held = iter(llm.stream("a b", max_new_tokens=4))  # prompts of two tokens each: the first cache fits them all
    next(held)  # this stream holds the cache now
    llm.generate("c d", max_new_tokens=4)
    assert len(made) == 1  # so the next generation needed a cache of its own


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_next_turn_starts_from_the_rows_the_last_generation_left(tmp_path, dtype: str) -> None:
    """Eager exact steps: a prompt that resends the last prompt and answer reads only the rest of itself, and gets
    the answer and K/V it gets alone; the rest in one part, and in several where it is longer than PREFILL_ROWS (the
    cache then made anew, the kept rows copied into it)."""
    folder = write_tiny_checkpoint(tmp_path, WORDS, max_positions=640)
    llm = LLM.load(Path(folder), dtype=dtype, device="cpu", progress=False, compile=False)
    assert llm.model.step_runner is None
    first = llm.encode("a b c hello")
    assert_next_turns_answer_as_alone(llm, first, llm.encode(" the cat sat"))
    longer = llm.encode(" the cat sat on the mat" * 60)
    assert len(longer) > PREFILL_ROWS
    assert_next_turns_answer_as_alone(llm, first, longer)


def test_rows_written_by_other_kernels_are_not_kept(llm: LLM, monkeypatch) -> None:
    """The K/V a generation leaves serve the next one only while the model's attention kernel and step runner are
    the ones that wrote them; a prompt that shares nothing with them keeps none either."""
    first = llm.generate("a b c", max_new_tokens=6)
    following = first.prompt_ids + first.token_ids
    assert llm.generate(following, max_new_tokens=2).stats.kept_tokens > 0
    assert llm.generate([7, 8, 9], max_new_tokens=2).stats.kept_tokens == 0
    llm.generate(following, max_new_tokens=2)
    monkeypatch.setattr(llm.model, "attention_kernel", copy.copy(llm.model.attention_kernel))
    assert llm.generate(following, max_new_tokens=2).stats.kept_tokens == 0


def test_generating_in_another_thread_than_the_loading_one_warns_once(llm: LLM, monkeypatch) -> None:
    """While the thread that loaded the model lives, a generation in another thread warns (two OpenMP pools), once,
    and gives the same answer; the loading thread's own generations do not warn."""
    monkeypatch.setattr(llm, "_home", threading.current_thread())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        here = llm.generate("a b c", max_new_tokens=6)
        assert seen == []
        there: list = []
        worker = threading.Thread(target=lambda: there.extend(llm.generate("a b c", max_new_tokens=6) for _ in "ab"))
        worker.start()
        worker.join()
    assert [t.token_ids for t in there] == [here.token_ids] * 2
    assert len(seen) == 1 and seen[0].category is RuntimeWarning and "OpenMP" in str(seen[0].message)


def test_the_caller_never_runs_in_inference_mode(llm: LLM) -> None:
    pieces = iter(llm.stream("a b c", max_new_tokens=6))
    next(pieces)
    assert not torch.is_inference_mode_enabled()
    x = torch.ones(2, requires_grad=True)
    assert (x * 2).requires_grad


def test_one_stop_string_is_not_split_into_characters(llm: LLM) -> None:
    full = llm.generate("a b c", max_new_tokens=24)
    text = full.text
    # A 3-character stop string whose characters all occur before it: split into characters, it would cut early.
    stop = next(text[i:i + 3] for i in range(3, len(text) - 3)
                if text.index(text[i:i + 3]) == i and max(text.index(c) for c in text[i:i + 3]) < i)
    cut = llm.generate("a b c", max_new_tokens=24, stop=stop)
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]


@pytest.mark.parametrize("options,fact", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=True), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(stop=["ok", ""]), "stop strings must be non-empty"),
    (dict(strategy="beam"), "unknown strategy 'beam'"),
    (dict(strategy=42), "strategy must be a Strategy"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
])
def test_bad_options_are_one_line_value_errors(llm: LLM, options: dict, fact: str) -> None:
    with pytest.raises(ValueError, match=fact) as error:
        llm.stream("a b", **options)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("prompt,options,fact", [
    ([1, 2.7, 3], {}, "prompt token id 2.7 is not an id of the vocabulary"),
    ([1, 10 ** 9], {}, "prompt token id 1000000000 is not an id"),
    ([], {}, "the prompt is empty"),
    ([1, 2, 3], dict(system="be brief"), "not to token ids"),
    ([1, 2, 3], dict(chat=True), "not to token ids"),
    ("a b", dict(system="be brief"), "needs chat=True"),
])
def test_bad_prompts_are_rejected_before_anything_runs(llm: LLM, prompt, options: dict, fact: str) -> None:
    with pytest.raises(ValueError, match=fact):
        llm.stream(prompt, **options)


def test_token_ids_text_and_chat_prompts(llm: LLM) -> None:
    ids = llm.encode("a b c")
    assert llm.generate(ids, max_new_tokens=5).token_ids == llm.generate("a b c", max_new_tokens=5).token_ids
    chat = llm.encode("hello", chat=True, system="be brief")
    assert chat == llm.encode([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert llm.tokenizer.decode(chat) == "system: be brief\nuser: hello\nassistant:"


def test_lookahead_through_the_library_equals_plain_decoding(llm: LLM) -> None:
    plain = llm.generate("the cat sat on the mat the cat", max_new_tokens=40, strategy="autoregressive")
    fast = llm.generate("the cat sat on the mat the cat", max_new_tokens=40, strategy=Lookahead(3, 3, 3))
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    assert fast.stats.strategy == "lookahead" and plain.stats.compression == pytest.approx(40 / 40)


def test_from_transformers_equals_loading_the_same_weights_from_disk(tmp_path: Path) -> None:
    import transformers

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    folder = write_tiny_checkpoint(tmp_path, WORDS, max_positions=128, chat_template=template)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(folder)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    bridged = LLM.from_transformers(hf_model, hf_tokenizer)
    from_disk = LLM.load(folder, dtype="float32", device="cpu", progress=False, compile=False)
    for prompt, options in [("the cat sat", {}), ("hello", dict(chat=True, system="be brief"))]:
        want = from_disk.generate(prompt, max_new_tokens=12, strategy=Lookahead(2, 3, 2), **options)
        got = bridged.generate(prompt, max_new_tokens=12, strategy=Lookahead(2, 3, 2), **options)
        assert got.prompt_ids == want.prompt_ids and got.token_ids == want.token_ids
    # Its generation_config gives the defaults that the same file next to the checkpoint gives.
    hf_model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.2)
    hf_model.generation_config.save_pretrained(folder)
    expected = dict(temperature=0.6, top_k=50, top_p=0.9, repetition_penalty=1.2)
    assert LLM.from_transformers(hf_model, hf_tokenizer).generation_defaults == expected
    assert LLM.load(folder, dtype="float32", device="cpu", progress=False).generation_defaults == expected
    # The weights are the transformers model's own tensors, not copies (only q/k/v and gate/up are fused anew).
    assert bridged.model.tok_embeddings.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    assert bridged.model.layers[0].attention.wo.weight.data_ptr() == \
        hf_model.model.layers[0].self_attn.o_proj.weight.data_ptr()


def test_the_default_strategy_is_auto_with_plain_decodings_output(llm: LLM) -> None:
    """The strategy this project exists for is the default, and it does draft: it fed drafts, accepted some
    (fewer forward passes than tokens), and gave plain decoding's tokens; plain decoding is one option away."""
    default = llm.generate("the cat sat on the mat the cat", max_new_tokens=30)
    plain = llm.generate("the cat sat on the mat the cat", max_new_tokens=30, strategy="autoregressive")
    assert default.stats.strategy == "auto" and plain.stats.strategy == "autoregressive"
    assert default.token_ids == plain.token_ids
    assert any(not kind.plain for kind in default.stats.step_kinds), default.stats.step_kinds
    assert default.stats.forward_passes < default.stats.new_tokens == plain.stats.forward_passes


def test_load_keeps_what_it_measured_where_the_cli_does(tmp_path: Path, monkeypatch) -> None:
    """LLM.load keeps the check's verdicts, the chosen dtype and auto's step costs in the CLI's folder; a second
    load reads them instead of checking and timing again; tables=False keeps nothing."""
    import json

    from minilade import device
    from minilade.decoding import step_costs

    (tmp_path / "tiny").mkdir()
    folder = write_tiny_checkpoint(tmp_path / "tiny", WORDS, max_positions=128)
    monkeypatch.setenv("MINILADE_TABLES", str(tmp_path / "tables"))
    (tmp_path / "tables").mkdir()
    first = LLM.load(folder, progress=False, compile=False)  # dtype auto: each candidate checked and timed
    want = first.generate("the cat sat", max_new_tokens=8)
    checks = json.loads((tmp_path / "tables" / "invariance.json").read_text())
    assert any(key.endswith("|dtype") for key in checks) and (tmp_path / "tables" / "step_costs.json").is_file()

    def measured(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(device, "check_invariance", measured)
    monkeypatch.setattr(device, "measure_step_costs", measured)
    monkeypatch.setattr(step_costs, "measure_step_costs", measured)
    again = LLM.load(folder, progress=False, compile=False)
    assert again.model.dtype == first.model.dtype and again.tables == tmp_path / "tables"
    assert again.generate("the cat sat", max_new_tokens=8).token_ids == want.token_ids

    monkeypatch.undo()  # measuring allowed again
    monkeypatch.setenv("MINILADE_TABLES", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    unkept = LLM.load(folder, progress=False, tables=False, compile=False)
    unkept.generate("the cat sat", max_new_tokens=4)
    assert unkept.tables is None and unkept.cost_file is None and not any((tmp_path / "elsewhere").iterdir())


def test_an_auto_without_a_cost_file_gets_the_llms(llm: LLM, monkeypatch) -> None:
    """Step costs are kept where the LLM keeps its tables, for auto by name and for an Auto given without a
    cost_file; an Auto's own cost_file stays."""
    import minilade.text_stream as module
    from minilade import Auto

    given, decode = [], module.decode_tokens
    monkeypatch.setattr(module, "decode_tokens", lambda model, ids, run, settings, **kw: (
        given.append(settings.strategy), decode(model, ids, run, settings, **kw))[1])
    llm.generate("the cat", max_new_tokens=2)
    llm.generate("the cat", max_new_tokens=2, strategy=Auto(window=2, ngram=3, guesses=2))
    llm.generate("the cat", max_new_tokens=2, strategy=Auto(window=2, ngram=3, guesses=2, cost_file="mine.json"))
    assert llm.cost_file is not None and llm.cost_file.endswith("step_costs.json")
    assert [s.cost_file for s in given] == [llm.cost_file, llm.cost_file, "mine.json"]


def test_a_generation_reports_the_peak_memory(llm: LLM) -> None:
    import resource

    out = llm.generate("the cat", max_new_tokens=2)
    assert out.peak_memory >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 * 0.99 > 0
    assert out.as_dict()["peak_memory_mib"] == round(out.peak_memory / 2**20, 1)


def test_generate_many_gives_each_prompt_what_it_gets_alone_in_shared_passes(llm: LLM, monkeypatch) -> None:
    """Greedy (auto, lookahead, plain) and seeded sampling, stop strings, a chat prompt: each result equals
    generate()'s for its prompt alone, in order, and the generations did share passes."""
    import minilade.serve.engine as engine

    widest, batched = [0], engine.batched_forward
    monkeypatch.setattr(engine, "batched_forward",
                        lambda model, calls, *rest: widest.append(len(calls)) or batched(model, calls, *rest))
    prompts = ["a b c", "the cat sat on the mat the cat", [3, 4, 5, 6], "hello world", "mat sat"]
    for options in (dict(), dict(strategy=Lookahead(3, 3, 3)), dict(strategy="autoregressive", stop="t"),
                    dict(temperature=0.9, top_p=0.9, seed=7)):
        handed: dict = {}
        many = llm.generate_many(prompts, concurrency=3, max_new_tokens=24, on_done=handed.__setitem__, **options)
        assert sorted(handed) == list(range(len(prompts))) and all(handed[i] is g for i, g in enumerate(many))
        alone = [llm.generate(prompt, max_new_tokens=24, **options) for prompt in prompts]
        assert [(g.token_ids, g.text, g.finish_reason) for g in many] == \
            [(g.token_ids, g.text, g.finish_reason) for g in alone], options
    assert max(widest) == 3  # three generations in one pass, never more
    chat = llm.generate_many(["hello"], chat=True, system="be brief", max_new_tokens=8)
    assert chat[0].prompt_ids == llm.encode("hello", chat=True, system="be brief")


def test_generate_many_starts_later_prompts_from_the_rows_of_earlier_ones(llm: LLM) -> None:
    """Prompts that share a beginning: one at a time, each after the first reads only what the ones before did not
    (stats.kept_tokens), and answers as it does alone."""
    shared = llm.encode("the cat sat on the mat " * 4)
    prompts = [shared + llm.encode(tail) for tail in ("a b", "hello world", "c d")]
    many = llm.generate_many(prompts, concurrency=1, max_new_tokens=12)
    assert many[0].stats.kept_tokens == 0 and all(g.stats.kept_tokens >= len(shared) for g in many[1:])
    for prompt, got in zip(prompts, many):
        llm.drop_kept_rows()
        assert got.token_ids == llm.generate(prompt, max_new_tokens=12).token_ids


def test_generate_many_checks_every_prompt_before_anything_runs(llm: LLM, monkeypatch) -> None:
    import minilade.serve.engine as engine

    monkeypatch.setattr(engine.Engine, "submit", lambda *args: pytest.fail("a generation was queued"))
    with pytest.raises(ValueError, match="the prompt has 200 tokens but the model's context is 128"):
        llm.generate_many(["a b", [1] * 200])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        llm.generate_many(["a b"], temperature=-1.0)
    with pytest.raises(ValueError, match="concurrency must be a whole number >= 1"):
        llm.generate_many(["a b"], concurrency=0)
    assert llm.generate_many([]) == []


def test_generate_many_raises_a_failed_generations_error_and_an_interrupt_winds_the_others_down(
        llm: LLM, monkeypatch) -> None:
    import minilade.serve.engine as engine

    stream = engine.TextStream

    def failing(view, prompt_ids, settings):
        if prompt_ids == [9, 9, 9]:
            raise ValueError("this one fails")
        return stream(view, prompt_ids, settings)

    with monkeypatch.context() as patch:
        patch.setattr(engine, "TextStream", failing)
        with pytest.raises(ValueError, match="this one fails"):
            llm.generate_many([[3, 4], [9, 9, 9], [5, 6]], max_new_tokens=16)
    passes, batched = [], engine.batched_forward

    def interrupted(model, calls, *rest):
        passes.append(len(calls))
        if len(passes) == 3:
            raise KeyboardInterrupt
        return batched(model, calls, *rest)

    with monkeypatch.context() as patch:
        patch.setattr(engine, "batched_forward", interrupted)
        before = threading.active_count()
        with pytest.raises(KeyboardInterrupt):
            llm.generate_many(["a b c", "hello world", "the cat"], max_new_tokens=16)
    for thread in threading.enumerate():
        if thread.name == "minilade-request":
            thread.join(10)
    assert threading.active_count() <= before  # no request's worker is left waiting for a pass
    assert [g.token_ids for g in llm.generate_many(["a b c"], max_new_tokens=8)] == \
        [llm.generate("a b c", max_new_tokens=8).token_ids]


def test_generate_many_refuses_a_model_split_over_ranks(llm: LLM, monkeypatch) -> None:
    import minilade.llm

    monkeypatch.setattr(minilade.llm, "process_group", lambda model: object())  # as a sharded model's head says
    with pytest.raises(ValueError, match="not one split over ranks"):
        llm.generate_many(["a b"])
