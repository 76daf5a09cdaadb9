"""The command line: bad input is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minilade.cli import build_parser, settings_from_args
from minilade.generate import main
from minilade.llm import LLM
from minilade.tokenizer import Tokenizer

from .helpers import assert_cli_error, run_cli, write_tiny_checkpoint

transformers = pytest.importorskip("transformers")


def tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_checkpoint(folder)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "a b c d hello world", max_positions=64)


def test_generates_json(tiny_checkpoint: Path) -> None:
    result = run_cli("a b c d", "--ckpt", str(tiny_checkpoint), "--max-new-tokens", "5", "--json",
                     "--strategy", "lookahead", "-W", "2", "-N", "3", "-G", "2")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    expected = LLM.load(tiny_checkpoint, progress=False, compile=False).generate("a b c d", max_new_tokens=5,
                                                                  strategy="autoregressive")
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    assert out["finish_reason"] == expected.finish_reason
    assert out["prompt_tokens"] == len(tokenizer(tiny_checkpoint).encode("a b c d"))
    stats = out["stats"]
    assert stats["strategy"] == "lookahead" and stats["new_tokens"] == len(out["token_ids"])
    assert stats["forward_passes"] == stats["steps"] + 1 and sum(stats["tokens_per_step"].values()) == stats["steps"]


def test_the_cli_keeps_what_it_measured_where_minilade_tables_says(tiny_checkpoint: Path, monkeypatch,
                                                                   tmp_path: Path) -> None:
    """A run keeps the invariance verdict and auto's step costs under $MINILADE_TABLES (the session's folder for
    every other test); a folder of its own here, so that the run must measure and write both."""
    monkeypatch.setenv("MINILADE_TABLES", str(tmp_path / "tables"))
    (tmp_path / "tables").mkdir()
    assert main(["a b", "--ckpt", str(tiny_checkpoint), "--max-new-tokens", "3"]) == 0
    for name in ("invariance.json", "step_costs.json"):
        table = json.loads((tmp_path / "tables" / name).read_text())
        assert table and all(key.startswith("L2-") for key in table), table  # the tiny model's shape, measured


def test_prompt_from_stdin_and_stats_on_stderr(tiny_checkpoint: Path) -> None:
    result = run_cli("--ckpt", str(tiny_checkpoint), "--max-new-tokens", "4", stdin="a b c")
    assert result.returncode == 0, result.stderr
    n = len(tokenizer(tiny_checkpoint).encode("a b c"))
    assert "tok/s" in result.stderr and f"[auto] prompt {n} tok" in result.stderr
    assert re.search(r", peak memory [1-9][0-9]* MiB, finish: length", result.stderr), result.stderr


@pytest.mark.parametrize("args,fact", [
    (["--ckpt", "/nonexistent/model.gguf"], "checkpoint not found"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "1", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "-3"], "top_k must be >= 0"),
    (["--top-k", "5"], "apply only when sampling"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--stop", ""], "stop strings must be non-empty"),
    (["--strategy", "lookahead", "--ngram", "1"], "ngram size N must be >= 2"),
    (["--strategy", "lookahead", "--window", "0"], "window W must be >= 1"),
    (["--strategy", "lookahead", "--guesses", "-1"], "guesses G must be >= 0"),
    (["--dtype", "float8"], "unknown dtype"),
    (["--temperature", "1e-40", "--seed", "-1"], "seed must be in [0, 2**64)"),
    (["--temperature", "inf"], "temperature must be >= 0 and finite"),
    (["--device", "foo"], "unknown device 'foo'"),
    (["--device", "meta"], "device 'meta' is not supported"),
])
def test_bad_settings_fail_in_one_line(tiny_checkpoint: Path, args: list[str], fact: str) -> None:
    assert_cli_error(run_cli("hello", *(["--ckpt", str(tiny_checkpoint)] + args)), fact)


def test_prompt_longer_than_context(tiny_checkpoint: Path) -> None:
    assert_cli_error(run_cli(" ".join(["a"] * 80), "--ckpt", str(tiny_checkpoint)), "context is 64 tokens")


def test_truncated_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny_checkpoint / name).read_bytes())
    data = (tiny_checkpoint / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:len(data) // 2])
    assert_cli_error(run_cli("a b", "--ckpt", str(tmp_path)), "model.safetensors")


def test_wrong_architecture(tiny_checkpoint: Path, tmp_path: Path) -> None:
    for f in tiny_checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_cli_error(run_cli("a b", "--ckpt", str(tmp_path)), "unsupported architecture 'gpt2'")


def test_interactive_chat_keeps_the_conversation(tmp_path: Path) -> None:
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    folder = write_tiny_checkpoint(tmp_path, "a b c d hello world", max_positions=256, chat_template=template)
    result = run_cli("--interactive", "--ckpt", str(folder), "--max-new-tokens", "3", "--system", "be brief",
                     stdin="hello\nworld\n\n")
    assert result.returncode == 0, result.stderr
    summaries = [line for line in result.stderr.splitlines() if line.startswith("[auto]")]
    assert len(summaries) == 2  # one reply per user turn, then the empty line ends the chat
    first, second = (int(line.split("prompt ")[1].split(" tok")[0]) for line in summaries)
    assert second > first  # the second turn's prompt holds the first exchange too


def test_chat_without_template(tiny_checkpoint: Path) -> None:
    assert_cli_error(run_cli("a b", "--chat", "--ckpt", str(tiny_checkpoint)), "no chat template")


def test_main_returns_exit_code(tiny_checkpoint: Path, capsys) -> None:
    assert main(["a", "--ckpt", str(tiny_checkpoint), "--temperature", "1", "--top-p", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: top_p")


def test_a_tiny_temperature_samples_the_argmax(tiny_checkpoint: Path) -> None:
    cold = run_cli("a b", "--ckpt", str(tiny_checkpoint), "--json", "--max-new-tokens", "6", "--temperature", "1e-40",
                   "--seed", "3")
    greedy = run_cli("a b", "--ckpt", str(tiny_checkpoint), "--json", "--max-new-tokens", "6")
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout)["token_ids"] == json.loads(greedy.stdout)["token_ids"]



def test_minilade_tables_naming_a_file_is_a_one_line_error(tiny_checkpoint: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("MINILADE_TABLES", str(afile))
    assert_cli_error(run_cli("hello", "--ckpt", str(tiny_checkpoint)), f"$MINILADE_TABLES names {afile}, which is not")

def test_a_prompt_that_is_not_utf8(tiny_checkpoint: Path) -> None:
    """Bytes that are not UTF-8 on the command line arrive as lone surrogates; on stdin they fail to decode."""
    assert main(["a \udcff b", "--ckpt", str(tiny_checkpoint)]) == 2
    result = subprocess.run([sys.executable, "-m", "minilade.generate", "--ckpt", str(tiny_checkpoint)],
                            input=b"a \xff\xfe b", capture_output=True, timeout=300)
    assert result.returncode == 2 and b"Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and b"utf-8" in result.stderr.lower()


def test_interactive_chat_drops_the_oldest_turns_when_the_context_fills(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    folder = write_tiny_checkpoint(tmp_path, "a b c d hello world", max_positions=64, chat_template=template)
    turns = "".join(f"hello world a b c d {i}\n" for i in range(6)) + "\n"
    result = run_cli("--interactive", "--ckpt", str(folder), "--max-new-tokens", "4", stdin=turns)
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stderr.splitlines() if line.startswith("[auto]")]
    assert len(replies) == 6 and "dropped the oldest exchange" in result.stderr
    prompts = [int(line.split("prompt ")[1].split(" tok")[0]) for line in replies]
    assert max(prompts) <= 64 * 3 // 4


def test_padded_vocabulary_never_yields_an_undecodable_id(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, "a b c d hello world", max_positions=64, vocab_padding=40)
    llm = LLM.load(folder, progress=False, compile=False)
    n_tokens = llm.tokenizer.vocab_size
    assert llm.model.config.vocab_size == n_tokens + 40 and llm.model.output.weight.shape[0] == n_tokens
    for seed in range(5):
        out = llm.generate("a b", max_new_tokens=16, temperature=2.0, seed=seed)
        assert max(out.token_ids) < n_tokens


@pytest.mark.parametrize("mode", ["int8", "int4", "w7a8"])
def test_quantized_lookahead_equals_quantized_plain_decoding(tiny_checkpoint: Path, mode: str) -> None:
    common = ["a b c d", "--ckpt", str(tiny_checkpoint), "--json", "--max-new-tokens", "12", "--quantize", mode]
    plain = run_cli(*common, "--strategy", "autoregressive")
    fast = run_cli(*common, "--strategy", "lookahead", "-W", "2", "-N", "3", "-G", "2")
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
    assert json.loads(fast.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


def test_bad_group_size_fails_before_loading(tiny_checkpoint: Path) -> None:
    assert_cli_error(run_cli("a", "--ckpt", "/nonexistent.gguf", "--quantize", "int4", "--group-size", "48"),
                          "group_size must be one of")


def test_auto_on_a_tiny_context_shrinks_its_steps_and_lookahead_says_what_to_change(tmp_path: Path) -> None:
    """`--strategy auto -W 12` on a 32-token context answers (plain decoding's tokens, to the
    context's end); explicit lookahead whose step cannot fit is one line naming the options, exit 2."""
    folder = write_tiny_checkpoint(tmp_path, "a b c d hello world", max_positions=32)
    common = ("a b c hello", "--ckpt", str(folder), "--max-new-tokens", "60", "--json")
    plain = run_cli(*common, "--strategy", "autoregressive")
    auto = run_cli(*common, "--strategy", "auto", "-W", "12")
    assert plain.returncode == 0 and auto.returncode == 0, auto.stderr
    assert json.loads(auto.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert json.loads(auto.stdout)["finish_reason"] == "context"
    assert_cli_error(run_cli(*common, "--strategy", "lookahead", "-W", "12"),
                          "feeds up to 51 tokens, more than the model's whole context of 32; choose a smaller "
                          "window (-W)")


@pytest.mark.parametrize("args,fact", [
    (["--stop", ""], "stop strings must be non-empty"),
    (["--temperature", "1", "--seed", str(2 ** 64)], "seed must be in [0, 2**64)"),
    (["--repetition-penalty", "-1"], "repetition_penalty must be > 0"),
])
def test_bad_options_are_refused_before_the_checkpoint_is_even_looked_for(args: list[str], fact: str,
                                                                         capsys) -> None:
    """A checkpoint that does not exist is never reached, so nothing was loaded first."""
    assert main(["a", "--ckpt", "/nonexistent/model.gguf", *args]) == 2
    err = capsys.readouterr().err
    assert fact in err and "not found" not in err and len(err.strip().splitlines()) == 1


def test_list_models_prints_the_support_table_without_a_checkpoint(capsys) -> None:
    from minilade.checkpoints.support import describe_support
    assert main(["--list-models", "--ckpt", "/nonexistent.gguf"]) == 0  # never looks for a checkpoint
    out = capsys.readouterr().out
    assert out == describe_support() + "\n" and "Qwen2" in out and "Q6_K" in out


def test_strategy_options_are_the_strategies_fields_with_their_defaults() -> None:
    from minilade.decoding import Auto, Lookahead
    parse = build_parser().parse_args
    assert settings_from_args(parse(["p", "--strategy", "lookahead"])).strategy == Lookahead()
    auto = settings_from_args(parse(["p"])).strategy
    assert (auto.window, auto.ngram, auto.guesses, auto.suffix_draft, auto.recycle_topk) == \
        (Auto.window, Auto.ngram, Auto.guesses, Auto.suffix_draft, Auto.recycle_topk)
    given = settings_from_args(parse(["p", "-W", "3", "-N", "2", "-G", "1", "--no-prompt-pool", "--suffix-draft", "5",
                                      "--suffix-branches", "2", "--recycle-topk", "8", "--draft-budget", "20"]))
    assert dataclasses.replace(given.strategy, cost_file=None) == Auto(3, 2, 1, pool_from_prompt=False, suffix_draft=5,
                                                                        suffix_branches=2, recycle_topk=8,
                                                                        draft_budget=20)


def test_an_option_the_strategy_does_not_have_is_a_one_line_error() -> None:
    assert_cli_error(run_cli("a", "--ckpt", "/nonexistent.gguf", "--strategy", "lookahead", "--recycle-topk",
                                  "2"), "--recycle-topk applies to --strategy auto, not lookahead")
    assert_cli_error(run_cli("a", "--ckpt", "/nonexistent.gguf", "--strategy", "autoregressive", "-W", "3"),
                          "--window applies to --strategy lookahead or auto, not autoregressive")
    assert_cli_error(run_cli("a", "--ckpt", "/nonexistent.gguf", "--recycle-topk", "-1"), "recycle_topk")


def test_auto_options_on_the_command_line_give_plain_decodings_tokens(tiny_checkpoint: Path) -> None:
    common = ["a b c d", "--ckpt", str(tiny_checkpoint), "--json", "--max-new-tokens", "12"]
    plain = run_cli(*common, "--strategy", "autoregressive")
    fast = run_cli(*common, "-W", "3", "-N", "3", "-G", "2", "--recycle-topk", "3", "--suffix-draft", "4")
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
    assert json.loads(fast.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]



def test_prompts_from_a_json_lines_file_print_one_object_a_line_in_order(tiny_checkpoint: Path, tmp_path: Path,
                                                                          capsys) -> None:
    lines = ['"a b c"', '{"prompt": "hello world"}', "", '{"prompt": "d d a", "id": 7}', '"b"']
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["--prompts", str(tmp_path / "prompts.jsonl"), "--ckpt", str(tiny_checkpoint), "--max-new-tokens", "6",
            "--concurrency", "2", "--compile", "off"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = [json.loads(line) for line in captured.out.splitlines()]
    llm = LLM.load(tiny_checkpoint, progress=False, compile=False)
    assert [o["line"] for o in out] == [1, 2, 4, 5]
    for o, prompt in zip(out, ["a b c", "hello world", "d d a", "b"]):
        alone = llm.generate(prompt, max_new_tokens=6)
        assert (o["token_ids"], o["text"]) == (alone.token_ids, alone.text)
    assert "4 prompts, 24 new tokens in" in captured.err and "up to 2 at once" in captured.err


@pytest.mark.parametrize("content,args,fact", [
    ('"a b"\n{"prompt": \n', [], "line 2 is not JSON"),
    ('"a b"\n[1, 2]\n', [], 'line 2: expected a string, or an object with "prompt"'),
    ('{"messages": []}\n', [], "line 1: expected a string"),
    ("\n\n", [], "holds no prompts"),
    ('"a b"\n"' + "a " * 80 + '"\n', [], "line 2: the prompt has"),
    ('"a b"\n', ["--concurrency", "0"], "--concurrency must be >= 1"),
    ('"a b"\n', ["a b"], "give no prompt argument"),
    ('"a b"\n', ["--chat", "--system", "x"], "line 1: this checkpoint has no chat template"),
])
def test_bad_prompt_files_fail_in_one_line(tiny_checkpoint: Path, tmp_path: Path, content: str, args: list[str],
                                           fact: str, capsys) -> None:
    (tmp_path / "prompts.jsonl").write_text(content)
    assert main(["--prompts", str(tmp_path / "prompts.jsonl"), "--ckpt", str(tiny_checkpoint), "--compile", "off",
                 *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fact in err[0], err


def test_a_missing_prompt_file_is_one_line(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    assert main(["--prompts", str(tmp_path / "none.jsonl"), "--ckpt", str(tiny_checkpoint)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No such file" in err[0], err
