"""Decoding steps of any shape through compiled graphs (minilade/compiled.py): exact, for every strategy.

Compiling is slow on a small CPU, so the models are tiny and few: every test reuses the one compiled function
(compiled.compiled_layers_step), which keeps a graph per model, dtype, weight kind and one-row or wider step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minilade import Auto, Autoregressive, Lookahead, attention_op, compile_policy, compiled, saved_graphs
from minilade.compile_policy import choose_steps
from minilade.compiled import chunked_attention, compile_steps, graph_layout
from minilade.config import ModelConfig
from minilade.device import check_invariance, make_exact
from minilade.invariance import invariant_attention, key_layout, pad_keys_values
from minilade.masks import interleaved_step
from minilade.model import Transformer, step_visibility
from minilade.quant import quantize_embedding, quantize_linears
from tests.helpers import FLAT_COSTS, checked_runs, run_tokens, step_eagerly_and_by, tiny_model

# One worker under pytest-xdist compiles these graphs, once (compiled graphs live in the process that made them).
pytestmark = pytest.mark.xdist_group("compiled")


def compiled_model(kind: str, sliding_window: int = 0, graphs: Path | None = None) -> Transformer:
    """A tiny model made exact (device.make_exact) with compiled steps: float32, bfloat16, int8, int4 or w7a8
    layers; graphs: where to keep them (compiled.SavedSteps), or traced in this process."""
    config = ModelConfig.preset("tiny-gqa").replace(vocab_size=32, dim=64, head_dim=16, intermediate_size=128,
                                                    sliding_window=sliding_window)  # int4 groups of 32 inputs
    model = Transformer(config).init_random(seed=3, std=0.3).eval()
    if kind == "bfloat16":
        model = model.to(torch.bfloat16)
    elif kind in ("int8", "int4", "w7a8"):
        quantize_embedding(quantize_linears(model, kind, 32))
    assert make_exact(model).exact
    return compile_steps(model, graphs)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4", "w7a8"])
def test_compiled_rows_are_the_same_at_every_row_count(kind: str) -> None:
    """A token's logits through compiled steps are bitwise the same in a one-row step, a causal multi-row step
    and a lookahead step's interleaved rows (the load-time check, run through the compiled graphs)."""
    model = compiled_model(kind)
    assert model.step_runner is not None
    assert check_invariance(model, contexts=(5, 70))


def test_compiled_rows_keep_their_bits_where_the_attention_operator_does_not_build(monkeypatch) -> None:
    """Without the C++ operator (attention_op.py), float32 steps attend through chunked_attention, exact too, and
    the runner's name (under which verdicts and graphs are kept) says which."""
    monkeypatch.setattr(attention_op, "load", lambda: "the C++ attention operator did not build: a test's")
    monkeypatch.setattr(attention_op, "_loaded", False)
    model = compiled_model("float32")
    assert "attention op" not in model.step_runner.name
    assert check_invariance(model, contexts=(5, 70))


def test_compiled_steps_compute_the_models_step() -> None:
    """The compiled step is the eager step's function: the same logits up to rounding, a sliding window
    included, and the same cache rows written."""
    model = compiled_model("float32", sliding_window=6)
    logits, caches = step_eagerly_and_by(model, model.step_runner)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[0], caches[1], rtol=1e-5, atol=1e-5)


def test_chunked_attention_is_invariant_attention() -> None:
    """Uncompiled, the graph's attention (all slots in chunks, the tail gathered) gives invariant_attention's rows
    bitwise, for a causal and a lookahead step."""
    gen = torch.Generator().manual_seed(0)
    past, T, H, Hkv, D = 70, 8, 4, 2, 16
    q = torch.randn(1, H, T, D, generator=gen)
    keys, values = torch.randn(1, Hkv, past + T, D, generator=gen), torch.randn(1, Hkv, past + T, D, generator=gen)
    for mask in (None, interleaved_step(past, T, lanes=4)[1]):
        visible = step_visibility(mask, past, T, "cpu")
        layout = key_layout(visible, past, H // Hkv, torch.float32)
        step_layout = graph_layout(layout)
        Sp = step_layout[0].shape[-1]
        want = invariant_attention(q, *pad_keys_values(keys, values, layout.keys), layout)
        got = chunked_attention(q, *pad_keys_values(keys, values, Sp), *step_layout)
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["float32", "int4", "w7a8"])
def test_greedy_lookahead_and_auto_equal_plain_decoding_through_compiled_steps(kind: str) -> None:
    model = compiled_model(kind)
    runs = checked_runs(model, seed=1, strategies=[Lookahead(4, 3, 3), Auto(4, 3, 3, costs=FLAT_COSTS)], trials=2)
    assert any(run.stats.compression > 1 for _, run in runs)  # drafts were accepted: fewer steps than tokens


def test_compiled_steps_refuse_other_devices() -> None:
    with pytest.raises(ValueError, match="CPU only, not meta"):
        compile_steps(tiny_model().to("meta"))


def test_plain_decoding_runs_one_row_steps_through_the_compiled_runner() -> None:
    model = compiled_model("int4")
    rows, runner = [], model.step_runner

    def counting(*args):
        rows.append(args[1].shape[1])
        return runner(*args)

    counting.runs_prefill = runner.runs_prefill
    model.step_runner = counting
    tokens, run = run_tokens(model, [3, 1, 4], Autoregressive(), max_new_tokens=12)
    assert len(tokens) == 12 and rows == [1] * 11  # the prefill runs eagerly; every later step compiled


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> Path:
    """A folder of kept tables shared by this module's tests of saved graphs (each w7a8 graph compiled once)."""
    return tmp_path_factory.mktemp("kept")


def test_steps_are_compiled_when_asked_and_exact_and_the_setup_says_so(monkeypatch, kept, capsys) -> None:
    """choose_steps (what LLM.load(compile=...) runs): forced, the compiled runner is installed, its verdict kept
    in the check file and its graphs beside it, the two kinds compiled at once (the wider in a second process,
    whose saved graph the check's steps then load); without a C++ compiler the model stays eager and the reason is
    given."""
    model = compiled_model("w7a8")
    model.step_runner = None
    check_file = kept / "invariance.json"
    assert choose_steps(model, check_file, force=True).startswith("compiled steps")  # the check passed
    err = capsys.readouterr().err
    assert "compiling the graphs of one-row and of wider steps (in two processes)... " in err
    assert "compiling the graph of" not in err and "did not save" not in err and "refuses" not in err, err
    assert model.step_runner is not None and check_file.exists()
    assert len(list((kept / saved_graphs.GRAPHS_FOLDER).glob("*.pt2"))) == 2  # one-row steps and wider ones
    monkeypatch.setattr(compile_policy.shutil, "which", lambda name: None)
    model.step_runner = None
    assert choose_steps(model, check_file, force=True) == \
        "eager steps (no C++ compiler (g++, c++ or clang++) on PATH)"
    assert model.step_runner is None


def test_a_second_process_that_fails_leaves_its_graph_to_the_first_step_of_its_kind(tmp_path, monkeypatch,
                                                                                    capsys) -> None:
    """compile_policy.compile_kinds_at_once: where the second process does not save the wider steps' graph, one line
    says so, and the first wider step compiles it here; the steps are still the ones a model compiled here
    computes."""
    parent, compile_graph = os.getpid(), compiled.SavedSteps.compile

    def failing_in_the_second_process(self, kind, args):
        if os.getpid() != parent:
            raise RuntimeError("a test's")
        return compile_graph(self, kind, args)

    monkeypatch.setattr(compiled.SavedSteps, "compile", failing_in_the_second_process)
    model = compiled_model("w7a8", graphs=tmp_path)
    compile_policy.compile_kinds_at_once(model)
    assert "the second process did not save its graphs (exit status 1)" in capsys.readouterr().err
    assert len(list(tmp_path.glob("*.pt2"))) == 1
    got = two_steps(model)
    assert "compiling the graph of wider steps... " in capsys.readouterr().err
    assert len(list(tmp_path.glob("*.pt2"))) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, two_steps(compiled_model("w7a8")), strict=True))


def two_steps(model: Transformer, capacity: int = 40) -> list[torch.Tensor]:
    """The logits of a one-row step and of a four-row step after a 9-token prompt (the cache made as generation
    makes it, outside inference mode)."""
    cache = model.new_cache(capacity)
    with torch.inference_mode():
        model(torch.arange(9)[None] % 7, torch.arange(9), cache)
        cache.commit(9)
        one = model(torch.tensor([[3]]), torch.tensor([9]), cache)
        return [one, model(torch.arange(4)[None], torch.arange(9, 13), cache)]


LATER_PROCESS = """
import sys
from pathlib import Path
import torch
from tests.decoding.test_compiled import compiled_model, two_steps
torch.save(two_steps(compiled_model("w7a8", graphs=Path(sys.argv[1])), capacity=300), sys.argv[2])
print("graphs traced:", torch._dynamo.utils.counters["stats"]["unique_graphs"])
"""


def test_saved_graphs_serve_a_later_process_without_tracing_and_a_damaged_one_is_compiled_again(kept, tmp_path
                                                                                               ) -> None:
    """compiled.SavedSteps: the graphs one process compiled (one-row and wider steps) load in another, which traces
    nothing and computes the same logits bit for bit, over a cache of another size; a file that does not load is
    compiled again, saying so."""
    graphs, logits = kept / saved_graphs.GRAPHS_FOLDER, tmp_path / "logits.pt"
    want = two_steps(compiled_model("w7a8", graphs=graphs))
    saved = sorted(graphs.glob("*.pt2"))
    assert len(saved) == 2

    def later_process() -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-c", LATER_PROCESS, str(graphs), str(logits)], capture_output=True,
                              text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr[-2000:]
        assert all(torch.equal(a, b) for a, b in zip(want, torch.load(logits), strict=True))
        return done

    assert later_process().stdout.split()[-1] == "0"
    saved[0].write_bytes(b"not a graph")
    again = later_process()
    assert "compiling again" in again.stderr and again.stdout.split()[-1] == "1"
    assert sorted(graphs.glob("*")) == saved and saved[0].stat().st_size > 1000


def test_a_step_the_saved_graph_refuses_runs_through_a_graph_traced_here(kept, capsys) -> None:
    """Where a saved graph's guards refuse a step, that kind of step runs through compiled_layers_step from then on
    (one line on stderr says so), which computes what a model compiled in this process computes."""
    model = compiled_model("w7a8", graphs=kept / saved_graphs.GRAPHS_FOLDER)
    two_steps(model)  # the saved graphs loaded (or compiled)
    saved = model.step_runner.run_layers

    def refusing(*args):
        raise RuntimeError("GuardManager check failed, reason: a test's")

    saved.graphs = dict.fromkeys(saved.graphs, refusing)
    got = two_steps(model)
    assert "refuses this one" in capsys.readouterr().err
    assert refusing not in saved.graphs.values()
    assert all(torch.equal(a, b) for a, b in zip(got, two_steps(compiled_model("w7a8")), strict=True))
