"""Native steps (native_steps.py) on tiny w7a8 models: a row's bits are the same at every row count, every strategy
gives plain decoding's output through them, they compute the model's step, and LLM.load chooses them."""

from __future__ import annotations

import pytest
import torch

from minilade import Auto, Lookahead, compile_policy, native_steps
from minilade.compile_policy import choose_steps
from minilade.config import ModelConfig
from minilade.device import check_invariance, make_exact
from minilade.integer_linear import W7A8Linear
from minilade.masks import interleaved_step
from minilade.model import Transformer
from minilade.native_steps import NativeCall, NativeSteps, layers_pass, native_missing, take_over
from minilade.quant import quantize_embedding, quantize_linears
from minilade.sampling import carried_choices, largest
from tests.helpers import FLAT_COSTS, checked_runs, step_eagerly_and_by


def w7a8_model(head_dim: int = 16, sliding_window: int = 0, kind: str = "w7a8", heads: tuple[int, int] = (6, 2)
               ) -> Transformer:
    """A tiny model made exact (device.make_exact), its linear layers quantized as `kind`, its steps eager; heads:
    its query and key-value heads."""
    config = ModelConfig.preset("tiny-gqa").replace(vocab_size=32, dim=64, head_dim=head_dim, intermediate_size=128,
                                                    sliding_window=sliding_window, n_heads=heads[0],
                                                    n_kv_heads=heads[1])
    model = Transformer(config).init_random(seed=3, std=0.3).eval()
    quantize_embedding(quantize_linears(model, kind, 32))
    assert make_exact(model).exact
    return model


def native_model(head_dim: int = 16, sliding_window: int = 0, heads: tuple[int, int] = (6, 2)) -> Transformer:
    model = w7a8_model(head_dim, sliding_window, heads=heads)
    assert native_missing(model) is None
    model.step_runner = NativeSteps()
    return model


@pytest.mark.parametrize("head_dim, sliding_window, heads", [(16, 0, (6, 2)), (8, 0, (6, 2)), (16, 6, (6, 2)),
                                                             (16, 0, (10, 2))])
def test_native_rows_are_the_same_at_every_row_count(head_dim: int, sliding_window: int,
                                                     heads: tuple[int, int]) -> None:
    """A token's logits through native steps are bitwise the same in a one-row step, a causal multi-row step and a
    lookahead step's interleaved rows (the load-time check), whatever the head width (a multiple of the operator's
    16 lanes or not), with a sliding window that cuts the rows' keys, and with a group of query heads the
    operator's attention takes one head at a time."""
    assert check_invariance(native_model(head_dim, sliding_window, heads), contexts=(5, 70))


@pytest.mark.parametrize("outputs, inputs", [(96, 64), (64, 128), (37, 13), (130, 2051), (7, 1)])
def test_the_operators_matmul_gives_fbgemms_bits_at_every_row_count(outputs: int, inputs: int) -> None:
    """The operator's own integer matmul (csrc/native_matmul.h) gives what fbgemm's w7a8 call gives, bit for bit, at
    every row count of its row tiles and wider, for weights whose outputs fill no whole column block and whose inputs
    no whole quad of codes, and for rows of any magnitude, zero included."""
    assert native_steps.load() is None
    ops = torch.ops.minilade_native_layer
    if not ops.has_integer_matmul():
        pytest.skip("this processor has no integer dot products: fbgemm's call computes every matmul")
    generator = torch.Generator().manual_seed(outputs * inputs)
    weight = W7A8Linear(torch.randn(outputs, inputs, generator=generator))
    for rows in [*range(1, 14), 16, 17, 31, 33]:  # tiles from 4 rows (kTileMinRows)
        x = torch.randn(rows, inputs, generator=generator) * torch.logspace(-3, 3, rows)[:, None]
        x[rows // 2] = 0.0
        fbgemms = ops.linear(x, *weight.weight_codes(), True)
        for tiles in {False, native_steps.has_matrix_tiles()}:
            native_steps.use_matrix_tiles(tiles)
            ours = ops.linear(x, *weight.weight_codes(), False)
            assert torch.equal(ours, fbgemms), (rows, tiles, (ours - fbgemms).abs().max().item())
    native_steps.use_matrix_tiles(False)


def test_on_matrix_tiles_a_native_step_has_the_bits_of_the_vector_loop() -> None:
    """Where the processor has matrix tiles (AMX), a native step with its matmuls on them gives the logits and keys
    of the same step on the vector loop, bit for bit, and its rows pass the load-time check (one-row, causal and
    lookahead-shaped steps the same bits)."""
    assert native_steps.load() is None
    if not native_steps.has_matrix_tiles():
        pytest.skip("this processor has no matrix tiles (AMX), or the kernel does not let this process use them")
    model = native_model()
    runs = []
    for tiles in (False, True):
        assert native_steps.use_matrix_tiles(tiles) == tiles
        runs.append(step_eagerly_and_by(model, NativeSteps()))
    try:
        assert check_invariance(model, contexts=(5, 70))
    finally:
        native_steps.use_matrix_tiles(False)
    (_, vector_logits), (_, vector_keys) = runs[0]
    (_, tiles_logits), (_, tiles_keys) = runs[1]
    assert torch.equal(vector_logits, tiles_logits) and torch.equal(vector_keys, tiles_keys)


def test_the_operators_head_is_the_models_norm_and_head_with_the_same_bits_at_every_row_count() -> None:
    """The operator's final norm and output head (native_steps.logits, the logits of every native step): a row's
    logits the same alone and among 13 others, whether the head's matmul is the operator's own or fbgemm's call,
    and the eager norm and head's function (the two round differently in the last bit; see below)."""
    model = native_model()
    ops = torch.ops.minilade_native_layer
    ours, fbgemms = native_steps.register_layers(model), native_steps.register_layers(model, integer_matmul=False)
    x = torch.randn(14, model.config.dim, generator=torch.Generator().manual_seed(5))
    logits, choices = ops.head(ours, x)
    assert logits.shape == (14, model.config.vocab_size)
    assert torch.equal(logits, torch.cat([ops.head(ours, row[None])[0] for row in x]))
    assert torch.equal(logits, ops.head(fbgemms, x)[0])
    assert torch.equal(choices, largest(logits))
    assert torch.equal(native_steps.logits(model, x), logits[None])
    assert torch.equal(carried_choices(native_steps.logits(model, x)), choices[None])
    with torch.inference_mode():
        assert relative_error(model.output(model.norm(x[None]))[0], logits) < 5e-2


@pytest.mark.parametrize("rows, vocabulary", [(1, 49152), (3, 32000), (2, 8193), (4, 7), (1, 1)])
def test_the_heads_greedy_choices_follow_largests_rule(rows: int, vocabulary: int) -> None:
    """Each row's greedy choice, as the operator's head makes it beside its logits (over column ranges split among
    threads), is sampling.largest's: the first of equal largest values, a NaN counting as largest, infinities
    included; on logits made to tie, hold NaNs and infinities in every part of a row."""
    assert native_steps.load() is None
    choices = torch.ops.minilade_native_layer.choices
    generator = torch.Generator().manual_seed(rows * vocabulary)
    for trial in range(40):
        logits = torch.randn(rows, vocabulary, generator=generator)
        if trial % 2:
            logits = torch.round(logits)  # many ties, across the threads' parts
        if trial % 3 == 0:
            logits[:, torch.randint(vocabulary, (3,), generator=generator)] = float("nan")
        if trial % 5 == 0:
            logits[0] = float("-inf")
        if trial % 7 == 0:
            logits[-1, torch.randint(vocabulary, (2,), generator=generator)] = float("inf")
        assert torch.equal(choices(logits), largest(logits)), trial


def test_taking_over_the_layers_lets_go_of_their_codes_and_keeps_the_bits() -> None:
    """native_steps.take_over (what LLM.load does once it chose native steps) leaves the layers' and the head's
    W7A8Linear modules without codes, packed or not, the operator computing from its own copy: the same logits and
    cache rows as before; the layers then refuse to run by themselves."""
    model = native_model()
    tokens, positions = torch.arange(3, 15)[None], torch.arange(12)[None]
    with torch.inference_mode():
        before, cache_before = model(tokens, positions, cache := model.new_cache(16)), cache
        take_over(model)
        after, cache_after = model(tokens, positions, cache := model.new_cache(16)), cache
        assert torch.equal(before, after)
        assert torch.equal(cache_before.k, cache_after.k) and torch.equal(cache_before.v, cache_after.v)
        linears = [m for m in model.modules() if isinstance(m, W7A8Linear)]
        assert len(linears) == 4 * len(model.layers) + 1 and all(m.handed_over for m in linears)  # + the head
        model.step_runner = None
        with pytest.raises(RuntimeError, match="handed to native steps"):
            model(tokens, positions, model.new_cache(16))


def test_greedy_lookahead_and_auto_equal_plain_decoding_through_native_steps() -> None:
    model = native_model()
    runs = checked_runs(model, seed=1, strategies=[Lookahead(4, 3, 3), Auto(4, 3, 3, costs=FLAT_COSTS)], trials=2)
    assert any(run.stats.compression > 1 for _, run in runs)  # drafts were accepted: fewer steps than tokens


def relative_error(want: torch.Tensor, got: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (4, 2), (8, 2), (10, 2)])
def test_native_steps_compute_the_models_step(heads: tuple[int, int]) -> None:
    """The native step is the eager step's function (the eager step's keys and values rounded to float16 as the
    operator keeps them), a sliding window included, and writes the same keys, in float16; for every group of query
    heads a key-value head serves (the operator's attention is compiled for groups of 1 to 4 and takes any other one
    head at a time). Compared in norm, not element by element: the two round differently in the last bit, and where
    that moves one of a row's 8-bit activation codes, every later number of the row moves by a code's worth (over 100
    prompts: up to 1.5e-2 of the logits' norm, 4e-3 of the keys'); a step one position off errs by 0.7-1.0."""
    model = native_model(sliding_window=6, heads=heads)
    logits, keys = step_eagerly_and_by(model, model.step_runner)
    assert keys[1].dtype == torch.float16
    assert relative_error(logits[0], logits[1]) < 5e-2
    assert relative_error(keys[0], keys[1]) < 1e-2


def test_one_pass_gives_each_call_what_its_step_alone_gives() -> None:
    """layers_pass over three calls of 1, 5 and 3 rows, each over its own cache (causal, lookahead-shaped and
    causal): each call's output rows and cache rows bitwise those of the call alone."""
    model = native_model()
    sizes = [(4, 1, None), (30, 5, interleaved_step(30, 5, lanes=2)), (11, 3, None)]

    def calls() -> list[NativeCall]:
        made = []
        for i, (past, T, step) in enumerate(sizes):
            cache = model.new_cache(64)
            model(torch.arange(past)[None] * (i + 3) % 32, torch.arange(past), cache)
            cache.commit(past)
            positions, mask = step if step is not None else (torch.arange(past, past + T), None)
            made.append(NativeCall(torch.arange(T) * 5 % 32, positions, cache, mask))
        return made

    with torch.inference_mode():
        together, alone = calls(), calls()
        x = layers_pass(model, together)
        rows = [layers_pass(model, [call]) for call in alone]
    assert torch.equal(x, torch.cat(rows))
    for a, b in zip(together, alone):
        assert torch.equal(a.cache.k, b.cache.k) and torch.equal(a.cache.v, b.cache.v)


@pytest.mark.parametrize("sliding_window", [0, 6])
def test_a_pass_lays_out_the_slots_its_step_masks_allow(sliding_window: int) -> None:
    """pass_slots (laid out in numpy) lists, for every row of a pass of causal and masked calls over caches of many
    lengths, the slots the model's step masks (Transformer.step_masks, with and without a sliding window) let it
    see, ascending, with each row's offsets."""
    model = w7a8_model(sliding_window=sliding_window)
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        calls = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            T, start = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(0, 40, (1,), generator=gen))
            mask = None if torch.rand(1, generator=gen) < 0.4 else \
                (torch.rand(T, T, generator=gen) < 0.5) | torch.eye(T, dtype=torch.bool)
            calls.append(NativeCall(torch.zeros(T, dtype=torch.long), torch.arange(start, start + T),
                                    model.new_cache(64), mask, past=start))
        slots, offsets = native_steps.pass_slots(model, calls)
        rows = []
        for call in calls:
            T = call.tokens.shape[0]
            visible, _ = model.step_masks(call.mask, call.start, T, call.positions)
            rows += list(torch.ones(T, T, dtype=torch.bool).tril() if visible is None else visible)
        assert slots.dtype == torch.int32 and offsets.tolist() == [0, *torch.tensor([int(r.sum()) for r in rows])
                                                                    .cumsum(0).tolist()]
        assert slots.tolist() == [slot for row in rows for slot in row.nonzero()[:, 0].tolist()]


def test_a_prompt_read_natively_in_parts_gets_the_bits_of_the_whole() -> None:
    """Native steps run the prefill too (Transformer.forward hands it to them): a prompt read in two parts, or its
    first part taken from rows a decoding step wrote, gives the logits and cache rows of the prompt read at once."""
    model = native_model()
    prompt = torch.arange(20) * 7 % 32
    with torch.inference_mode():
        whole = model.new_cache(32)
        want = model(prompt[None], torch.arange(20), whole)
        parts = model.new_cache(32)
        model(prompt[None, :11], torch.arange(11), parts)
        parts.commit(11)
        got = model(prompt[None, 11:], torch.arange(11, 20), parts)
    assert torch.equal(got, want[:, 11:])
    assert torch.equal(parts.k[:, :, :, :20], whole.k[:, :, :, :20])
    assert torch.equal(parts.v[:, :, :, :20], whole.v[:, :, :, :20])


def test_a_long_prompt_runs_in_parts_with_the_bits_of_one_pass(monkeypatch) -> None:
    """A causal forward longer than PROMPT_PART rows runs in passes of that many (bounding its visible slots, which
    grow as rows x keys): the same logits and cache rows as in one pass."""
    model = native_model()
    prompt = torch.arange(23) * 5 % 32
    results = []
    for part in (native_steps.PROMPT_PART, 4):
        monkeypatch.setattr(native_steps, "PROMPT_PART", part)
        with torch.inference_mode():
            cache = model.new_cache(32)
            results.append((model(prompt[None], torch.arange(23), cache), cache.k.clone(), cache.v.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_native_steps_serve_float32_w7a8_models_only() -> None:
    assert native_missing(w7a8_model(kind="int4")) == "native steps need every layer's weights in w7a8, without biases"
    assert native_missing(w7a8_model().to(torch.bfloat16)) == "native steps compute in float32, not bfloat16"
    assert native_missing(w7a8_model(head_dim=1024)) == "native steps need an even head width up to 512, not 1024"


def test_choose_steps_installs_native_steps_where_they_pass_and_measure_faster(tmp_path, monkeypatch) -> None:
    """choose_steps (what LLM.load(compile="auto") runs) installs native steps for a w7a8 model where they pass the
    check and step faster than eager ones, and keeps its verdict: a later choice measures nothing."""
    def timed(model, sizes, **_):
        return {T: (0.001 if isinstance(model.step_runner, NativeSteps) else 0.004) * T for T in sizes}

    monkeypatch.setattr(compile_policy, "measure_step_costs", timed)
    model, check_file = w7a8_model(), tmp_path / "invariance.json"
    assert choose_steps(model, check_file) == "native steps (9 ms for a 1- and an 8-row step, eager 36)"
    assert isinstance(model.step_runner, NativeSteps) and check_file.exists()
    monkeypatch.setattr(compile_policy, "measure_step_costs", None)  # a second load reads the kept verdict
    model.step_runner = None
    assert choose_steps(model, check_file).startswith("native steps")
    assert isinstance(model.step_runner, NativeSteps)


def test_choose_steps_puts_native_matmuls_on_matrix_tiles_where_they_measure_faster(tmp_path, monkeypatch) -> None:
    """Where the processor has matrix tiles, choose_steps times native steps with and without them, alternately,
    and keeps them on where faster (the verdict kept: a later load turns them on again without measuring); where
    they measure slower, off. The steps' name says which, so that their step costs are kept apart."""
    assert native_steps.load() is None
    if not native_steps.has_matrix_tiles():
        pytest.skip("this processor has no matrix tiles (AMX), or the kernel does not let this process use them")
    ops = torch.ops.minilade_native_layer
    try:
        for tiles_faster in (True, False):
            def timed(model, sizes, **_):
                native = isinstance(model.step_runner, NativeSteps)
                per_row = (0.002 if ops.uses_matrix_tiles() == tiles_faster else 0.003) if native else 0.004
                return {T: per_row * T for T in sizes}

            monkeypatch.setattr(compile_policy, "measure_step_costs", timed)
            model, check_file = w7a8_model(), tmp_path / f"invariance-{tiles_faster}.json"
            on_tiles = " on matrix tiles" if tiles_faster else ""
            assert choose_steps(model, check_file) == f"native steps{on_tiles} (18 ms for a 1- and an 8-row step, " \
                                                      "eager 36)"
            assert ops.uses_matrix_tiles() == tiles_faster
            assert ("on matrix tiles" in model.step_runner.name) == tiles_faster  # step costs kept apart
            native_steps.use_matrix_tiles(not tiles_faster)
            monkeypatch.setattr(compile_policy, "measure_step_costs", None)  # the kept verdict
            assert choose_steps(model, check_file).startswith(f"native steps{on_tiles} (")
            assert ops.uses_matrix_tiles() == tiles_faster
    finally:
        native_steps.use_matrix_tiles(False)


def test_choose_steps_says_why_when_the_operator_does_not_build_and_tries_compiled_steps(monkeypatch, capsys) -> None:
    class CompiledStepsTried(Exception):
        pass

    def compile_steps(model, graphs):
        raise CompiledStepsTried

    monkeypatch.setattr(compile_policy, "load_native", lambda: "the C++ native layer operator did not build: a test's")
    monkeypatch.setattr(compile_policy, "compile_steps", compile_steps)
    with pytest.raises(CompiledStepsTried):
        choose_steps(w7a8_model())
    assert capsys.readouterr().err == ("minilade: native steps unavailable (the C++ native layer operator did not "
                                       "build: a test's); trying compiled steps\n")
