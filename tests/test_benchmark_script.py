"""Smoke test of scripts/benchmark.py on a tiny random checkpoint and a tiny prompt set (no real weights or data).

It checks the plumbing (tables, JSON, plots, errors), never speed: timing belongs in the benchmark itself.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from .helpers import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # a bench extra, not a test one


def load_script(name: str):
    """A sibling script of benchmark.py as a module, so its main() runs in-process."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    """The script as a module, so its main() runs in-process (no second interpreter start-up)."""
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(autouse=True)
def restore_threads():
    """The runs below pass --threads 1 (tiny matmuls gain nothing from threads, and lose much on a busy machine);
    the script sets it process-wide, so put it back for the other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_auto(bench, monkeypatch):
    """A made-up step-cost curve, for the auto strategy and the step-cost table alike."""
    import minilade.decoding.step_costs

    def fake(model, sizes, **kw):
        return {t: 1e-3 * (1 + t / 8) for t in sizes}

    monkeypatch.setattr(minilade.decoding.step_costs, "measure_step_costs", fake)
    monkeypatch.setattr(bench, "measure_step_costs", fake)
    minilade.decoding.step_costs._MEASURED.clear()
    yield
    minilade.decoding.step_costs._MEASURED.clear()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random LLaMA folder with a byte-level BPE tokenizer and a minimal chat template."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "a b c d hello world def return",
                                 max_positions=256, chat_template=template)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The three prompt files with the fields the script reads, two records each."""
    folder = tmp_path_factory.mktemp("data")
    rows = {
        "mt_bench.jsonl": [{"turns": ["hello world a b", "second turn"]}, {"turns": ["a b c d a b c d", "x"]}],
        "humaneval.jsonl": [{"prompt": "def hello(a, b):\n    return a b"}, {"prompt": "def world():\n"}],
        "gsm8k_test.jsonl": [{"question": "a b c d hello", "answer": "4"}, {"question": "world world", "answer": "1"}],
    }
    for name, records in rows.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_decode_mode_writes_tables_json_and_plots(bench, fake_auto, tiny_checkpoint: Path, data_dir: Path,
                                                  tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--out-dir", str(out), "--quick",
            "--n-prompts", "2", "--max-new-tokens", "6", "--repeats", "2", "--settings", "2,3,2", "3,4,3", "--auto", "2,3,1",
            "--temperatures", "0", "0.8", "--step-sizes", "1", "4", "12", "--no-progress", "--threads", "1"]
    assert bench.main(argv + ([] if HAVE_MATPLOTLIB else ["--no-plots"])) == 0
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0].startswith("command: python ") and "--settings 2,3,2 3,4,3" in stdout
    for dataset in ("mt_bench", "humaneval", "gsm8k"):
        for config in ("minilade AR", "lookahead (2,3,2)", "lookahead (3,4,3)", "auto", "transformers generate",
                       "transformers prompt lookup"):
            assert f"| {dataset} | {config} |" in stdout
    assert "sampled, temperature 0.8" in stdout
    assert "published reference" not in stdout  # its figures are for the real model only

    doc = json.loads((out / "results.json").read_text())
    assert doc["command"] == stdout.splitlines()[0].removeprefix("command: ")
    # 3 datasets x 2 prompts x 2 repeats x (6 greedy configurations + 4 sampled ones)
    assert len(doc["records"]) == 3 * 2 * 2 * (6 + 4)
    greedy = {(s["dataset"], s["config"]): s for s in doc["summary"] if s["temperature"] == 0}
    ar = greedy[("mt_bench", "minilade AR")]
    assert ar["exact_match"] == 2 and ar["compression"] == 1.0 and ar["speedup_vs_ar"] == 1.0
    for dataset in ("mt_bench", "humaneval", "gsm8k"):  # greedy lookahead and float32 transformers equal AR
        for config in ("lookahead (2,3,2)", "lookahead (3,4,3)", "auto", "transformers generate"):
            assert greedy[(dataset, config)]["exact_match"] == 2, (dataset, config)
    assert greedy[("mt_bench", "transformers generate")]["forward_passes"] is None
    assert all(s["reference_compression"] is None for s in doc["summary"])
    assert doc["step_costs"]["source"] == "minilade.decoding.step_costs.measure_step_costs"
    assert doc["step_costs"]["seconds"] == {"1": 1e-3 * 1.125, "4": 1e-3 * 1.5, "12": 1e-3 * 2.5}
    if not HAVE_MATPLOTLIB:
        return
    for plot in ("speedup.png", "compression_vs_flops.png", "step_cost.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_ar_mode(bench, tiny_checkpoint: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    argv = ["ar", "--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--out-dir", str(tmp_path),
            "--quick", "--datasets", "humaneval", "--dtypes", "float32", "bfloat16", "--bandwidth-mib", "8",
            "--no-progress", "--threads", "1"]
    assert bench.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "memory bandwidth" in stdout
    doc = json.loads((tmp_path / "ar_results.json").read_text())
    assert [(r["dtype"], r["library"]) for r in doc["summary"]] == [
        ("float32", "minilade AR"), ("float32", "transformers generate"),
        ("bfloat16", "minilade AR"), ("bfloat16", "transformers generate")]
    assert doc["summary"][0]["weight_bytes_per_token"] == 2 * doc["summary"][2]["weight_bytes_per_token"]
    assert doc["summary"][0]["minilade_over_transformers"] > 0 and doc["summary"][1]["exact_match"] == 1
    assert doc["bandwidth"]["read_gb_s"] > 0 and doc["summary"][0]["weight_gb_s"] > 0


def test_missing_data_file_is_one_line_error(bench, tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "mt_bench.jsonl").write_text(json.dumps({"turns": ["a"]}) + "\n")
    assert bench.main(["--ckpt", str(tiny_checkpoint), "--data-dir", str(tmp_path), "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data file not found: ") and "humaneval.jsonl" in err[0]


def test_bad_setting_is_one_line_error(bench, capsys) -> None:
    assert bench.main(["--settings", "7,1,7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad lookahead setting '7,1,7'" in err[0]


def test_flops_per_step_formula(bench) -> None:
    from minilade.config import ModelConfig

    config = ModelConfig.preset("smollm2-135m")
    assert bench.step_shape((7, 5, 7)) == ((7 + 7) * 4, 1 + 7 + 7 * 4)
    non_embedding = config.n_params - config.vocab_size * config.dim  # tied: the embedding is counted once
    assert bench.flops_per_step(config, 1, 1) == 2 * non_embedding + 2 * config.vocab_size * config.dim


def test_exactness_script(tiny_checkpoint: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    script = load_script("exactness")
    out = tmp_path / "exactness.json"
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--n-prompts", "2", "--max-new-tokens", "8",
            "--settings", "2,3,2", "--out", str(out)]
    assert script.main(argv) == 0
    table = capsys.readouterr().out
    assert "| humaneval | (2, 3, 2) | 2/2 | - |" in table  # float32 greedy lookahead equals autoregressive
    records = json.loads(out.read_text())["records"]
    assert len(records) == 6 and all(r["same"] for r in records)
    assert script.main(["--data-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: prompt set not found")


def test_ablation_script(tiny_checkpoint: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    script = load_script("ablation")
    out = tmp_path / "ablation.json"
    argv = ["--ckpt", str(tiny_checkpoint), "--data-dir", str(data_dir), "--n-prompts", "2", "--max-new-tokens", "12",
            "--settings", "2,3,2", "--out", str(out)]
    assert script.main(argv) == 0  # every variant gave the same (exact) output
    table = capsys.readouterr().out
    assert "| minilade | no bonus token | no prompt pool | reference-like | same output |" in table
    assert "| gsm8k | (2, 3, 2) |" in table
    records = json.loads(out.read_text())["records"]
    assert len(records) == 3 * 2 * 4 and all(r["same_output"] for r in records)
    capped = [r for r in records if r["variant"] in ("no bonus token", "reference-like")]
    assert all(r["most_per_step"] <= 2 for r in capped)  # N - 1 = 2: the reference's cap holds
    assert script.main(["--data-dir", str(tmp_path)]) == 2


def test_matmul_floor_script(tiny_checkpoint: Path, capsys) -> None:
    script = load_script("matmul_floor")
    assert script.main(["--ckpt", str(tiny_checkpoint), "--reps", "2"]) == 0
    table = capsys.readouterr().out
    assert "| float32 |" in table and "| bfloat16 |" in table
