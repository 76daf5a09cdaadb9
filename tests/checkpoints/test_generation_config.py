"""A checkpoint's generation_config.json: its sampling defaults apply when the caller sets none, the caller's
options override them, and a bad file is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minilade.checkpoints.generation_config import (
    check_sampling,
    defaults_from_hf,
    merge_sampling,
    read_generation_defaults,
)
from minilade.errors import CheckpointError
from minilade.sampling import SamplingParams


@pytest.mark.parametrize("data,defaults", [
    ({"bos_token_id": 1, "eos_token_id": 2}, {}),  # SmolLM2's: greedy, no penalty
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, {"temperature": 0.6, "top_k": 50, "top_p": 0.9}),
    ({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
     {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}),  # Qwen2.5's
    ({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.1}, {"repetition_penalty": 1.1}),
])
def test_hugging_face_semantics(data: dict, defaults: dict) -> None:
    assert defaults_from_hf(data) == defaults


def test_caller_options_override_and_greedy_drops_sampling_only_defaults() -> None:
    defaults = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}
    assert merge_sampling(defaults, {"temperature": None, "top_p": None}) == SamplingParams(**defaults)
    assert merge_sampling(defaults, {"temperature": 0.0}) == SamplingParams(repetition_penalty=1.05)
    assert merge_sampling(defaults, {"repetition_penalty": 1.0, "seed": 3}) == SamplingParams(
        temperature=0.7, top_k=20, top_p=0.8, seed=3)
    assert merge_sampling({}, {}) == SamplingParams()


@pytest.mark.parametrize("text,fact", [
    ("{not json", "not a readable JSON file"),
    ("[1, 2]", "expected a JSON object"),
    ('{"do_sample": true, "temperature": -1}', "temperature must be >= 0"),
    ('{"do_sample": "yes"}', "do_sample must be true or false"),
    ('{"repetition_penalty": 0}', "repetition_penalty must be > 0"),
    ('{"do_sample": true, "top_k": 2.5}', "top_k must be >= 0, a whole number"),
    ('{"do_sample": true, "top_p": []}', r"top_p must be in \(0, 1\]"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path: Path, text: str, fact: str) -> None:
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=fact) as caught:
        read_generation_defaults(tmp_path)
    assert "generation_config.json" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("name,value", [("temperature", -1), ("top_k", 2.5), ("top_p", 0), ("seed", -1),
                                        ("repetition_penalty", 0), ("presence_penalty", 3), ("frequency_penalty", "x")])
def test_an_option_checked_alone_fails_as_the_settings_do(name: str, value: object) -> None:
    """The command line checks its options before the checkpoint's defaults are known, by SamplingParams' rules."""
    with pytest.raises(ValueError) as whole:
        SamplingParams(**{"temperature": 1.0, name: value})
    with pytest.raises(ValueError) as alone:
        check_sampling({name: value})
    assert str(alone.value) == str(whole.value)


def test_no_file_no_defaults(tmp_path: Path) -> None:
    assert read_generation_defaults(tmp_path) == {}
    (tmp_path / "model.gguf").write_bytes(b"")
    assert read_generation_defaults(tmp_path / "model.gguf") == {}


def test_the_checkpoint_defaults_reach_the_library_and_the_command_line(tmp_path: Path) -> None:
    from minilade.llm import LLM

    from ..helpers import assert_cli_error, run_cli, write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path, "a b c d hello world", max_positions=64)
    (folder / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.5, "eos_token_id": 2}))
    llm = LLM.load(folder, progress=False, compile=False)
    assert llm.generation_defaults == {"repetition_penalty": 1.5}
    by_default = llm.generate("a b c", max_new_tokens=24).token_ids
    assert by_default == llm.generate("a b c", max_new_tokens=24, repetition_penalty=1.5,
                                      strategy="autoregressive").token_ids
    assert by_default != llm.generate("a b c", max_new_tokens=24, repetition_penalty=1.0).token_ids
    common = ("a b c", "--ckpt", str(folder), "--max-new-tokens", "24", "--json")
    assert json.loads(run_cli(*common).stdout)["token_ids"] == by_default
    overridden = run_cli(*common, "--repetition-penalty", "1", "--strategy", "autoregressive")
    assert json.loads(overridden.stdout)["token_ids"] != by_default
    assert_cli_error(run_cli(*common, "--repetition-penalty", "0"), "repetition_penalty must be > 0")
    assert_cli_error(run_cli(*common, "--presence-penalty", "3"), "presence_penalty must be in [-2, 2]")
