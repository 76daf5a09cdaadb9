"""scripts/bench/common.py: prompt sets, settings, the usage error, the machine record, atomic files, medians."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from scripts.bench import common


def test_lookahead_setting_is_validated_by_the_library() -> None:
    assert common.lookahead_setting("7,5,7") == (7, 5, 7)
    for bad, why in [("7,1,7", "ngram size N must be >= 2"), ("0,5,7", "window W must be >= 1"),
                     ("7,5", "expected W,N,G"), ("a,b,c", "expected W,N,G")]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            common.lookahead_setting(bad)


def test_usage_errors_are_one_line_with_exit_status_2(stderr_line) -> None:
    parser = common.JobParser("scripts.bench.example", None)
    common.add_prompt_options(parser, n_prompts=3)
    common.add_settings_option(parser, [(7, 5, 7)])

    def job(argv: list[str]) -> int:
        parser.parse_args(argv)
        return 0

    assert common.run_job(job, []) == 0
    assert common.run_job(job, ["--n-prompts", "0"]) == 2
    assert stderr_line() == "error: argument --n-prompts: must be >= 1, got 0"
    assert common.run_job(job, ["--settings", "3,3,3", "7,1,7"]) == 2
    assert stderr_line().startswith("error: argument --settings: bad lookahead setting '7,1,7'")
    assert common.run_job(job, ["--datasets", "mmlu"]) == 2
    assert "invalid choice: 'mmlu'" in stderr_line()


def test_prompt_texts_take_each_sets_field_and_skip_blank_lines(tmp_path: Path) -> None:
    (tmp_path / "mt_bench.jsonl").write_text('{"turns": ["first", "second"]}\n\n{"turns": ["third"]}\n')
    (tmp_path / "humaneval.jsonl").write_text('{"prompt": "def f():"}\n')
    texts = common.load_prompt_texts(tmp_path, ["mt_bench", "humaneval"], n=5)
    assert texts == {"mt_bench": ["first", "third"], "humaneval": ["def f():"]}
    assert common.load_prompt_texts(tmp_path, ["mt_bench"], n=1) == {"mt_bench": ["first"]}
    assert [s.chat for s in common.DATASETS.values()] == [True, False, True, True]  # humaneval: raw completion


def test_the_second_turn_follows_the_models_own_greedy_answer(tiny_checkpoint: Path, data_dir: Path) -> None:
    from minilade import LLM

    texts = common.load_prompt_texts(data_dir, ["mt_bench_turn2"], n=1)
    assert texts == {"mt_bench_turn2": [common.TwoTurns("hello world a b", "second turn")]}
    llm = LLM.load(tiny_checkpoint, compile=False)
    ids = common.encode_prompts(llm, texts, show_progress=False, first_answer_tokens=6)["mt_bench_turn2"][0]
    answer = llm.generate("hello world a b", chat=True, max_new_tokens=6, temperature=0.0, strategy="autoregressive")
    assert answer.token_ids  # the tiny model says something, which the second turn's context must hold
    assert ids == llm.encode([{"role": "user", "content": "hello world a b"},
                              {"role": "assistant", "content": answer.text},
                              {"role": "user", "content": "second turn"}])
    assert llm.tokenizer.decode(ids).startswith("user: hello world a b\nassistant: ")
    assert llm.tokenizer.decode(ids).endswith("\nuser: second turn\nassistant:")


def test_a_missing_data_file_is_named_before_any_is_read(tmp_path: Path) -> None:
    (tmp_path / "mt_bench.jsonl").write_text("not json\n")  # never parsed: the missing file is found first
    with pytest.raises(common.UsageError, match=r"data file not found: .*gsm8k_test\.jsonl \(pass --data-dir\)"):
        common.load_prompt_texts(tmp_path, ["mt_bench", "gsm8k"], n=1)


def test_median_seconds_drops_the_warm_up_call() -> None:
    durations = iter([100.0, 3.0, 1.0, 2.0])  # the first (warm-up) call is slowest and must not count
    now = [0.0]
    calls = []

    def clock() -> float:
        return now[0]

    def fn() -> None:
        calls.append(1)
        now[0] += next(durations)

    assert common.median_seconds(fn, reps=3, clock=clock) == 2.0
    assert len(calls) == 4


def test_write_atomic_never_leaves_a_half_written_file(tmp_path: Path) -> None:
    path = tmp_path / "out" / "results.json"
    common.write_json(path, {"a": 1})

    def crash(tmp: Path) -> None:
        tmp.write_text('{"a": ')
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        common.write_atomic(path, crash)
    assert json.loads(path.read_text()) == {"a": 1}  # the old file, whole
    assert os.listdir(path.parent) == ["results.json"]  # no temporary file left behind
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_environment_records_the_cpu_flags_that_decide_the_kernels() -> None:
    assert common.simd_flags("fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile ssse3") == [
        "amx_tile", "avx", "avx2", "avx512_bf16", "avx512f"]
    env = common.environment()
    assert env["threads"] >= 1 and env["git_commit"] and isinstance(env["cpu_flags"], list)
    machine = common.describe_machine(env)
    assert machine.splitlines()[1].startswith(f"cpu: {env['cpu']}; flags: ")


def test_command_line_quotes_what_needs_it() -> None:
    assert common.command_line("scripts.bench.decode", ["--out-dir", "my dir"]) == \
        "python -m scripts.bench.decode --out-dir 'my dir'"
