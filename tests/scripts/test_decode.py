"""scripts/bench/decode.py on a tiny random checkpoint: tables, JSON, plots and errors; the summary's arithmetic
checked against the records it came from and against records built by hand."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import statistics
from pathlib import Path

import pytest
import torch

from minilade.config import ModelConfig
from scripts.bench import common, decode
from scripts.bench.contenders import AR, AUTO, HF_GENERATE, Contender

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # a bench extra, not a test one
CONFIGS = ("minilade AR", "lookahead (2,3,2)", "lookahead (3,4,3)", "auto", "transformers generate",
           "transformers prompt lookup")


def fake_step_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A made-up step-cost curve, for the auto strategy and the step-cost table alike."""
    import minilade.decoding.step_costs

    def fake(model, sizes, **kw):
        return {t: 1e-3 * (1 + t / 8) for t in sizes}

    monkeypatch.setattr(minilade.decoding.step_costs, "measure_step_costs", fake)
    monkeypatch.setattr(decode, "measure_step_costs", fake)
    minilade.decoding.step_costs._MEASURED.clear()


@pytest.fixture(scope="module")
def decode_run(tiny_checkpoint: Path, data_dir: Path, tmp_path_factory):
    """One quick run, shared by the tests of this module: greedy and sampled, two lookahead settings, auto,
    transformers; (stdout, results.json, output folder)."""
    out = tmp_path_factory.mktemp("decode") / "out"
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--out-dir", str(out), "--quick",
            "--n-prompts", "2", "--max-new-tokens", "6", "--repeats", "2", "--settings", "2,3,2", "3,4,3",
            "--auto", "2,3,1", "--temperatures", "0", "0.8", "--step-sizes", "1", "4", "12", "--no-progress",
            "--threads", "1"]
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(io.StringIO()) as stdout:
        fake_step_costs(monkeypatch)
        assert decode.main(argv + ([] if HAVE_MATPLOTLIB else ["--no-plots"])) == 0
    torch.set_num_threads(threads)
    import minilade.decoding.step_costs
    minilade.decoding.step_costs._MEASURED.clear()  # the made-up costs must not reach other tests
    return stdout.getvalue(), json.loads((out / "results.json").read_text()), out


def test_decode_writes_tables_json_and_plots(decode_run) -> None:
    stdout, doc, out = decode_run
    assert stdout.splitlines()[0].startswith("command: python -m scripts.bench.decode ")
    assert "--settings 2,3,2 3,4,3" in stdout and stdout.splitlines()[2].startswith("cpu: ")
    for dataset in ("mt_bench", "humaneval", "gsm8k"):
        for config in CONFIGS:
            assert f"| {dataset} | {config} |" in stdout
    assert "sampled, temperature 0.8" in stdout
    assert "published reference" not in stdout  # its figures are for the real model only
    assert doc["command"] == stdout.splitlines()[0].removeprefix("command: ")
    # 3 datasets x 2 prompts x 2 repeats x (6 greedy contenders + 4 sampled ones)
    assert len(doc["records"]) == 3 * 2 * 2 * (6 + 4)
    assert doc["environment"]["cpu_flags"] == common.environment()["cpu_flags"]
    assert "load_average_1m_end" in doc["environment"] and doc["settings"]["settings"] == [[2, 3, 2], [3, 4, 3]]
    assert all(s["reference_compression"] is None for s in doc["summary"])
    assert doc["reference_figures"]["not_measured_by_this_run"] is True
    assert doc["step_costs"]["source"] == "minilade.decoding.step_costs.measure_step_costs"
    assert doc["step_costs"]["seconds"] == {"1": 1e-3 * 1.125, "4": 1e-3 * 1.5, "12": 1e-3 * 2.5}
    assert "| 12 | 2.50 | 2.22 |" in stdout  # the step-cost table: ms per pass, relative to 1 token
    if not HAVE_MATPLOTLIB:
        return
    for plot in ("speedup.png", "compression_vs_flops.png", "step_cost.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_decode_summary_is_what_the_records_say(decode_run) -> None:
    """Compression, exact matches and speedups recomputed from the raw records, and the table prints them."""
    stdout, doc, _ = decode_run
    greedy = {(s["dataset"], s["config"]): s for s in doc["summary"] if s["temperature"] == 0}
    ar = greedy[("mt_bench", "minilade AR")]
    assert ar["exact_match"] == 2 and ar["compression"] == 1.0 and ar["speedup_vs_ar"] == 1.0
    assert greedy[("mt_bench", "transformers generate")]["forward_passes"] is None
    for (dataset, config), s in greedy.items():
        first = [r for r in doc["records"] if (r["dataset"], r["config"], r["temperature"], r["rep"]) ==
                 (dataset, config, 0, 0)]
        ar_ids = {r["prompt"]: r["token_ids"] for r in doc["records"]
                  if (r["dataset"], r["config"], r["temperature"], r["rep"]) == (dataset, AR, 0, 0)}
        assert s["new_tokens"] == sum(r["new_tokens"] for r in first)
        assert s["exact_match"] == sum(r["token_ids"] == ar_ids[r["prompt"]] for r in first)
        # greedy lookahead, auto and float32 transformers all give the autoregressive tokens
        assert s["exact_match"] == 2, (dataset, config)
        if s["forward_passes"] is not None:
            assert s["forward_passes"] == sum(r["forward_passes"] for r in first)
            assert s["compression"] == pytest.approx(s["new_tokens"] / s["forward_passes"])
            assert f"| {dataset} | {config} | {s['tokens_fed_per_step'] or ''} | {s['new_tokens']} " \
                   f"| {s['forward_passes']} | {s['compression']:.2f} |" in stdout
        assert s["speedup_vs_ar"] == pytest.approx(speedup_from_records(doc["records"], dataset, config, AR))


def speedup_from_records(records: list[dict], dataset: str, config: str, base: str) -> float:
    def tokens_per_s(label: str) -> dict[int, float]:
        mine = [r for r in records if (r["dataset"], r["config"], r["temperature"]) == (dataset, label, 0)]
        prompts = sorted({r["prompt"] for r in mine})
        return {p: [r["new_tokens"] for r in mine if r["prompt"] == p and r["rep"] == 0][0]
                / statistics.median(r["wall_s"] for r in mine if r["prompt"] == p) for p in prompts}

    ours, theirs = tokens_per_s(config), tokens_per_s(base)
    return statistics.median(ours[p] / theirs[p] for p in ours)


def made_up(dataset: str, config: str, prompt: int, wall_s: float, ids: list[int], passes: int | None) -> dict:
    return dict(dataset=dataset, temperature=0.0, config=config, prompt=prompt, rep=0, wall_s=wall_s, decode_s=None,
                new_tokens=len(ids), forward_passes=passes, token_ids=ids, ids_sha1=str(ids))


def test_summary_arithmetic_on_records_built_by_hand() -> None:
    lookahead = Contender("lookahead (7,5,7)", "minilade", setting=(7, 5, 7))
    by_temperature = {0.0: [Contender(AR, "minilade"), lookahead, Contender(HF_GENERATE, "transformers")]}
    records = [made_up("humaneval", AR, 0, 4.0, [1, 2, 3, 4], 4), made_up("humaneval", AR, 1, 2.0, [5, 6], 2),
               made_up("humaneval", lookahead.label, 0, 1.0, [1, 2, 3, 4], 2),  # x4 the tokens/s
               made_up("humaneval", lookahead.label, 1, 4.0, [5, 7], 1),        # x0.5, and other tokens
               made_up("humaneval", HF_GENERATE, 0, 2.0, [1, 2, 3, 4], None),
               made_up("humaneval", HF_GENERATE, 1, 1.0, [5, 6], None)]
    config = ModelConfig.preset("smollm2-135m")
    reference = {("humaneval", (7, 5, 7)): {"compression": 2.02}}
    rows = {s["config"]: s for s in decode.summarize(records, by_temperature, config, reference)}
    assert list(rows) == [AR, lookahead.label, HF_GENERATE]
    s = rows[lookahead.label]
    assert (s["new_tokens"], s["forward_passes"], s["compression"]) == (6, 3, 2.0)
    assert s["exact_match"] == 1 and s["speedup_vs_ar"] == pytest.approx((4 + 0.5) / 2)  # the median of two
    assert s["lowest_vs_ar"] == pytest.approx(0.5) and s["prompts_below_x098_vs_ar"] == 1
    assert rows[AR]["lowest_vs_ar"] == 1.0 and rows[AR]["prompts_below_x098_vs_ar"] == 0
    assert s["speedup_vs_transformers"] == pytest.approx((2 + 0.25) / 2)
    assert s["tokens_per_s"] == pytest.approx(6 / 5.0)
    assert s["tokens_fed_per_step"] == 56 and s["reference_compression"] == 2.02
    assert rows[AR]["reference_compression"] is None and rows[HF_GENERATE]["compression"] is None
    table = decode.decode_tables(list(rows.values()))
    assert "| humaneval | lookahead (7,5,7) | 56 | 6 | 3 | 2.00 | 2.02 | 1.2 |  | 2.25 | 1.12 | 1/2 |" in table
    assert "ref. = the published reference implementation" in table


def test_reference_figures_come_from_their_file_with_their_provenance() -> None:
    reference = decode.load_reference()
    assert reference.model_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and reference.dtype == "float32"
    assert "hao-ai-lab/LookaheadDecoding" in reference.provenance
    assert reference.figures == {
        ("mt_bench", (7, 5, 7)): {"compression": 1.64, "tokens_per_s": 15.0},
        ("mt_bench", (15, 5, 15)): {"compression": 1.70},
        ("humaneval", (7, 5, 7)): {"compression": 2.02},
        ("humaneval", (15, 5, 15)): {"compression": 2.17},
    }
    doc = decode.reference_document(reference)
    assert doc["figures"][0] == {"dataset": "mt_bench", "setting": (7, 5, 7), "compression": 1.64,
                                 "tokens_per_s": 15.0}


def test_missing_data_file_is_one_line_error(tiny_checkpoint: Path, tmp_path: Path, stderr_line) -> None:
    (tmp_path / "mt_bench.jsonl").write_text(json.dumps({"turns": ["a"]}) + "\n")
    assert decode.main(["--ckpt", str(tiny_checkpoint), "--data-dir", str(tmp_path), "--quick", "--no-plots",
                        "--no-transformers"]) == 2
    err = stderr_line()
    assert err.startswith("error: data file not found: ") and "humaneval.jsonl" in err


def test_bad_options_are_one_line_errors(stderr_line) -> None:
    assert decode.main(["--settings", "7,1,7"]) == 2
    assert "bad lookahead setting '7,1,7'" in stderr_line()
    assert decode.main(["--temperatures", "-1"]) == 2
    assert stderr_line() == "error: argument --temperatures: must be >= 0, got -1"
    assert decode.main(["--dtypes", "float32"]) == 2  # the ar job's option
    assert "unrecognized arguments: --dtypes" in stderr_line()


def test_quick_changes_defaults_only() -> None:
    args = decode.parse_args(["--quick", "--settings", "7,5,7", "--auto", "none"])
    assert args.settings == [(7, 5, 7)] and args.auto == [None]
    assert (args.n_prompts, args.max_new_tokens, args.repeats, args.step_reps) == (1, 8, 1, 2)
    assert decode.parse_args([]).settings == [(7, 5, 7), (15, 5, 15), (3, 3, 3), (5, 4, 5), (1, 5, 3)]


def test_no_lookahead_leaves_only_the_plain_and_auto_rows() -> None:
    args = decode.parse_args(["--settings", "15,5,15", "--auto", "15,5,15", "--no-lookahead", "--no-transformers"])
    assert [c.label for c in decode.contenders(args, 0.0)] == [AR, AUTO]
    assert 120 in decode.default_step_sizes(args.settings)  # the settings still size the step-cost curve


def test_flops_per_step_formula() -> None:
    config = ModelConfig.preset("smollm2-135m")
    assert decode.step_shape((7, 5, 7)) == ((7 + 7) * 4, 1 + 7 + 7 * 4)
    assert decode.step_shape((3, 2, 3)) == ((3 + 3) * 1, 0 + 3 + 3 * 1)  # N = 2: the input token is not projected
    non_embedding = config.n_params - config.vocab_size * config.dim  # tied: the embedding is counted once
    assert decode.flops_per_step(config, 1, 1) == 2 * non_embedding + 2 * config.vocab_size * config.dim


def test_auto_takes_other_fields_after_its_step() -> None:
    args = decode.parse_args(["--auto", "7,5,7:recycle_topk=2,suffix_branches=1"])
    assert args.auto == [((7, 5, 7), {"recycle_topk": 2, "suffix_branches": 1})]
    auto = next(c for c in decode.contenders(args, 0.0) if c.label == decode.AUTO).strategy
    assert (auto.window, auto.ngram, auto.guesses, auto.recycle_topk, auto.suffix_branches) == (7, 5, 7, 2, 1)


def test_several_auto_rows_are_labelled_by_their_settings() -> None:
    args = decode.parse_args(["--auto", "7,5,7", "7,5,7:recycle_topk=8", "--no-lookahead", "--no-transformers"])
    rows = decode.contenders(args, 0.0)
    assert [c.label for c in rows] == [AR, f"{AUTO} (7,5,7)", f"{AUTO} (7,5,7:recycle_topk=8)"]
    assert [c.strategy.recycle_topk for c in rows[1:]] == [0, 8]


def test_the_same_auto_variant_twice_is_a_one_line_error(stderr_line) -> None:
    assert decode.main(["--auto", "7,5,7:recycle_topk=8", "7,5,7:recycle_topk=8"]) == 2
    assert stderr_line().startswith("error: argument --auto: each variant once")


@pytest.mark.parametrize("text, fact", [("7,5,7:nonsense=1", "auto has no field 'nonsense'"),
                                        ("7,5,7:recycle_topk=x", "recycle_topk needs a whole number"),
                                        ("7,5,7:draft_budget=0", "draft_budget"),
                                        ("7,5,7:costs=1", "auto has no field 'costs'")])
def test_bad_auto_fields_are_one_line_errors(text: str, fact: str, stderr_line) -> None:
    assert decode.main(["--auto", text]) == 2
    line = stderr_line()
    assert line.startswith("error: argument --auto: bad auto setting") and fact in line


def test_a_history_row_drafts_from_answers_to_other_prompts_only(tiny_checkpoint: Path, data_dir: Path,
                                                                 stderr_line) -> None:
    from minilade import LLM

    args = decode.parse_args(["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--datasets", "humaneval",
                              "gsm8k", "--n-prompts", "1", "--max-new-tokens", "5", "--auto", "2,3,1",
                              "2,3,1:history=1", "--no-lookahead", "--no-transformers", "--no-progress"])
    llm = LLM.load(tiny_checkpoint, compile=False)
    histories = decode.seeded_histories(args, llm)
    history = histories[1]
    assert history.frozen
    texts = common.load_prompt_texts(data_dir, ["humaneval", "gsm8k"], 2)
    answers = [llm.generate(ids, max_new_tokens=5, temperature=0.0, strategy="autoregressive").token_ids
               for ids in (ids for items in common.encode_prompts(llm, texts, False).values() for ids in items[1:])]
    assert len(history) == sum(map(len, answers))  # the second prompt of each set; the measured first one is not
    assert history.drafts(answers[0][:1], 4)[0].tokens == tuple(answers[0][1:])
    rows = decode.contenders(args, 0.0, histories)
    assert [c.label for c in rows] == [AR, f"{AUTO} (2,3,1)", f"{AUTO} (2,3,1:history=1)"]
    assert rows[1].strategy.history is None and rows[2].strategy.history is history
    assert decode.main(["--auto", "7,5,7:history=0"]) == 2
    assert stderr_line().endswith("history needs a number of prompts >= 1")
