"""Compare minilade's decoding strategies with plain autoregressive decoding and the transformers library.

    python -m scripts.bench.decode                  # 3 datasets x 20 prompts x 128 tokens, every contender
    python -m scripts.bench.decode --quick          # smoke test: 1 prompt a dataset x 8 tokens, 1 setting
    python -m scripts.bench.decode --settings 7,5,7 5,4,5 --temperatures 0 0.7 --n-prompts 5
    python -m scripts.bench.decode --no-lookahead --no-transformers --auto 7,5,7 7,5,7:recycle_topk=4  # two autos

Per dataset and contender (minilade autoregressive, lookahead at each --settings W,N,G, auto, transformers
generate, transformers prompt lookup): new tokens, forward passes, compression (new tokens per forward pass,
prefill included), tokens per second, speedups and exact matches; then the step-cost curve. Several --auto
variants give one row each, labelled by their settings. Writes results.json
and plots (speedup per dataset, compression against FLOPs per step, step cost) to --out-dir.

Timing (scripts/bench/timing.py): every contender warmed up, then run per prompt in a shuffled order, --repeats
times, median kept; speedups are medians over prompts of paired per-prompt ratios. A whole generate call is timed,
prefill included, for both libraries.

Datasets (../shared/data by default): mt_bench.jsonl (turns[0], chat template), humaneval.jsonl (prompt, raw
completion), gsm8k_test.jsonl (question, chat template); the first --n-prompts of each. `--datasets mt_bench_turn2`
adds MT-Bench's second turn (turns[1]), asked after turns[0] and the model's own greedy answer to it.
`--auto 7,5,7:history=20` adds an auto row that also drafts from plain decoding's answers to 20 other prompts of
each dataset (the 20 after the measured ones; seeded_histories). The published reference's
figures (reference_figures.json, not measured here) are printed beside ours as "ref." for its model in float32.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from minilade import LLM, Auto, Autoregressive, DraftHistory
from minilade.checkpoints import resolve_checkpoint
from minilade.config import ModelConfig
from minilade.decoding.step_costs import measure_step_costs

from . import plots
from .common import (
    CPU_DTYPES,
    DATASETS,
    JobParser,
    Setting,
    UsageError,
    add_prompt_options,
    add_settings_option,
    add_timed_options,
    encode_prompts,
    fmt,
    load_average,
    load_prompt_texts,
    lookahead_setting,
    options_record,
    parse_with_quick,
    positive_int,
    progress,
    run_timed_job,
    sampling_temperature,
    setting_text,
    write_json,
)
from .contenders import (
    AR,
    AUTO,
    HF_GENERATE,
    HF_PROMPT_LOOKUP,
    Contender,
    Runner,
    import_transformers,
    load_hf_model,
    lookahead_contender,
)
from .timing import (
    ContendersByTemperature,
    PromptResult,
    exact_matches,
    group_by_prompt,
    measure,
    paired_ratios,
    paired_speedup,
    warm_up,
)

MODULE = "scripts.bench.decode"
REFERENCE_FILE = Path(__file__).with_name("reference_figures.json")
DEFAULT_SETTINGS = [(7, 5, 7), (15, 5, 15), (3, 3, 3), (5, 4, 5), (1, 5, 3)]  # the last three are CPU-friendly
QUICK_DEFAULTS = dict(n_prompts=1, max_new_tokens=8, repeats=1, settings=[(3, 3, 3)], step_reps=2)
STEP_COST_SOURCE = "minilade.decoding.step_costs.measure_step_costs"


# ---- command line ----------------------------------------------------------------------------------------------

def auto_setting(text: str) -> tuple[Setting, dict[str, int]] | None:
    """'none' (no auto row), or 'W,N,G[:field=value,...]': auto's largest step and other Auto fields, e.g.
    7,5,7:recycle_topk=2 (values are whole numbers). history=H gives auto a
    DraftHistory seeded with plain decoding's answers to H other prompts of each dataset (seeded_history)."""
    if text == "none":
        return None
    shape, _, extra = text.partition(":")
    fields = {}
    for item in filter(None, extra.split(",")):
        key, _, value = item.partition("=")
        if key not in Auto.__dataclass_fields__ or key in ("window", "ngram", "guesses", "costs"):
            raise argparse.ArgumentTypeError(f"bad auto setting {text!r}: auto has no field {key!r} to set here")
        try:
            fields[key] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad auto setting {text!r}: {key} needs a whole number") from None
    if fields.get("history", 1) < 1:
        raise argparse.ArgumentTypeError(f"bad auto setting {text!r}: history needs a number of prompts >= 1")
    setting = lookahead_setting(shape)
    try:
        Auto(*setting, **{k: v for k, v in fields.items() if k != "history"})
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad auto setting {text!r}: {e}") from None
    return setting, fields


def auto_text(setting: Setting, fields: dict[str, int]) -> str:
    """The --auto text of an auto row: 'W,N,G[:field=value,...]'."""
    extra = ",".join(f"{k}={v}" for k, v in fields.items())
    return setting_text(setting) + (f":{extra}" if extra else "")


def build_parser() -> argparse.ArgumentParser:
    p = JobParser(MODULE, __doc__)
    add_prompt_options(p, n_prompts=20)
    p.add_argument("--dtype", choices=CPU_DTYPES, default="float32", help="the weights' dtype")
    p.add_argument("--quantize", choices=["none", "int8", "int4", "w7a8"], default="none",
                   help="minilade's linear layers quantized (the transformers rows keep float weights)")
    add_settings_option(p, DEFAULT_SETTINGS)
    p.add_argument("--no-lookahead", action="store_true",
                   help="leave out the lookahead rows (--settings then only add their sizes to the step-cost curve)")
    p.add_argument("--auto", type=auto_setting, nargs="+", default=[auto_setting("5,4,5")],
                   metavar="W,N,G[:FIELD=N,...]",
                   help="the auto strategy's largest step, and other Auto fields (7,5,7:recycle_topk=2); several "
                        "give several auto rows, timed side by side; 'none' leaves the auto row out")
    p.add_argument("--temperatures", nargs="+", type=sampling_temperature, default=[0.0],
                   help="0 = greedy (all rows); T > 0 runs the minilade rows sampled, seeded per prompt")
    p.add_argument("--prompt-lookup-tokens", type=positive_int, default=10,
                   help="transformers prompt_lookup_num_tokens")
    p.add_argument("--step-sizes", nargs="+", type=positive_int, default=None,
                   help="tokens per forward pass for the step-cost curve (default: powers of 2 and each setting's)")
    p.add_argument("--step-reps", type=positive_int, default=5, help="timed forward passes per step size (median kept)")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots (matplotlib not needed)")
    add_timed_options(p, QUICK_DEFAULTS)
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    args = parse_with_quick(build_parser(), argv, QUICK_DEFAULTS)
    texts = [auto_text(*a) for a in args.auto if a is not None]
    if len(set(texts)) < len(texts):
        raise UsageError(f"argument --auto: each variant once, please (got {', '.join(texts)})")
    return args


def contenders(args: argparse.Namespace, temperature: float, histories: dict[int, DraftHistory] | None = None
                ) -> list[Contender]:
    """The rows at one temperature: transformers generate is greedy only, so it joins at temperature 0.
    histories: the seeded history of each auto row given history=H (seeded_histories); an empty one without."""
    settings = [] if args.no_lookahead else args.settings
    rows = [Contender(AR, "minilade", Autoregressive())] + [lookahead_contender(s) for s in settings]
    autos = [a for a in args.auto if a is not None]
    for setting, fields in autos:
        label = AUTO if len(autos) == 1 else f"{AUTO} ({auto_text(setting, fields)})"
        own = {k: v for k, v in fields.items() if k != "history"}
        history = (histories or {}).get(fields["history"], DraftHistory()) if "history" in fields else None
        rows.append(Contender(label, "minilade", Auto(*setting, **own, history=history)))
    if temperature == 0 and not args.no_transformers:
        rows += [Contender(HF_GENERATE, "transformers"),
                 Contender(HF_PROMPT_LOOKUP, "transformers", prompt_lookup=args.prompt_lookup_tokens)]
    return rows


# ---- the published reference's figures -------------------------------------------------------------------------

@dataclass(frozen=True)
class Reference:
    """Figures of the published reference implementation (reference_figures.json): NOT measured by this job."""

    provenance: str
    model_file: str  # they hold for this checkpoint ...
    dtype: str       # ... in this dtype, greedy
    figures: dict[tuple[str, Setting], dict[str, float]]  # (dataset, setting) -> compression, tokens_per_s


def load_reference(path: Path = REFERENCE_FILE) -> Reference:
    doc = json.loads(path.read_text())
    figures = {(f["dataset"], tuple(f["setting"])): {k: v for k, v in f.items() if k not in ("dataset", "setting")}
               for f in doc["figures"]}
    return Reference(doc["provenance"], doc["model_file"], doc["dtype"], figures)


def reference_document(reference: Reference) -> dict:
    return {"provenance": reference.provenance, "not_measured_by_this_run": True,
            "figures": [dict(dataset=d, setting=s, **f) for (d, s), f in reference.figures.items()]}


# ---- step geometry ---------------------------------------------------------------------------------------------

def step_shape(setting: Setting | None) -> tuple[int, int]:
    """(tokens fed, rows projected to the vocabulary) of one step with all G candidates (see minilade/masks.py):
    (W + G)(N - 1) tokens; the input token (when N > 2), the newest level (W rows) and the G(N - 1) candidate rows
    are projected. Autoregressive (setting None): 1 and 1."""
    if setting is None:
        return 1, 1
    w, n, g = setting
    return (w + g) * (n - 1), (1 if n > 2 else 0) + w + g * (n - 1)


def flops_per_step(config: ModelConfig, tokens_fed: int, rows_projected: int) -> float:
    """FLOPs of one forward pass, counted as the weight matmuls:
        2 x non-embedding params x tokens fed  +  2 x vocab x dim x rows projected to the vocabulary.
    Attention over the cached context (4 x layers x heads x head_dim x context per token) is left out; at the
    lengths benchmarked here it is small next to the weights."""
    embedding = config.vocab_size * config.dim
    non_embedding = config.n_params - embedding * (1 if config.tie_word_embeddings else 2)
    return 2.0 * non_embedding * tokens_fed + 2.0 * embedding * rows_projected


# ---- summary and tables ----------------------------------------------------------------------------------------

def summarize(records: list[dict], by_temperature: ContendersByTemperature, model_config: ModelConfig,
              reference: dict[tuple[str, Setting], dict[str, float]]) -> list[dict]:
    """One row per (dataset, temperature, contender), in the order of DATASETS and of the contenders.
    reference: the figures to show beside greedy rows (empty when they do not apply to this run)."""
    grouped = group_by_prompt(records)
    settings = {c.label: c.setting for cs in by_temperature.values() for c in cs}  # keys in first appearance
    summary = [summary_row(key, rows, grouped, settings[key[2]], model_config, reference)
               for key, rows in grouped.items()]
    order = {label: i for i, label in enumerate(settings)}
    datasets = list(DATASETS)
    return sorted(summary, key=lambda s: (s["temperature"], datasets.index(s["dataset"]), order[s["config"]]))


def summary_row(key: tuple[str, float, str], rows: dict[int, PromptResult], grouped: dict, setting: Setting | None,
                model_config: ModelConfig, reference: dict) -> dict:
    dataset, temperature, label = key
    ar, hf = grouped.get((dataset, temperature, AR)), grouped.get((dataset, temperature, HF_GENERATE))
    passes = [r.forward_passes for r in rows.values()]
    new = sum(r.new_tokens for r in rows.values())
    fed, projected = step_shape(setting) if setting or label == AR else (None, None)
    ref = reference.get((dataset, setting), {}) if temperature == 0 else {}
    return dict(
        dataset=dataset, temperature=temperature, config=label, setting=setting, n_prompts=len(rows),
        new_tokens=new, forward_passes=sum(passes) if None not in passes else None,
        compression=new / sum(passes) if None not in passes else None,
        tokens_per_s=new / sum(r.wall_s for r in rows.values()),
        speedup_vs_ar=paired_speedup(rows, ar), speedup_vs_transformers=paired_speedup(rows, hf),
        lowest_vs_ar=min(paired_ratios(rows, ar), default=None),
        prompts_below_x098_vs_ar=sum(r < 0.98 for r in paired_ratios(rows, ar)) if ar else None,
        exact_match=exact_matches(rows, ar) if temperature == 0 else None,
        reps_agree=all(r.reps_agree for r in rows.values()),
        tokens_fed_per_step=fed, flops_per_step=flops_per_step(model_config, fed, projected) if fed else None,
        reference_compression=ref.get("compression"), reference_tokens_per_s=ref.get("tokens_per_s"))


def decode_tables(summary: list[dict]) -> str:
    """One markdown table per temperature, then the notes that apply."""
    out = []
    for temperature in sorted({s["temperature"] for s in summary}):
        out += temperature_table(temperature, [s for s in summary if s["temperature"] == temperature])
    if any(s["reference_compression"] for s in summary):
        out.append("\nref. = the published reference implementation on this machine, same model, float32 (figures "
                   "from our issue tracker, not measured by this run).")
    if not all(s["reps_agree"] for s in summary if s["temperature"] == 0):
        out.append("\nWARNING: some greedy repetitions produced different tokens (see reps_agree in results.json).")
    return "\n".join(out)


def temperature_table(temperature: float, rows: list[dict]) -> list[str]:
    sampled = temperature > 0
    out = [f"\n### {'greedy' if not sampled else f'sampled, temperature {temperature:g}'}\n"]
    if sampled:
        out.append("Exact match is not meaningful when sampling (lookahead keeps the distribution, not the "
                   "samples), so it is not reported; speedups are against minilade AR sampling at the same "
                   "temperature.\n")
    out.append("| dataset | configuration | tokens fed/step | new tokens | forward passes | compression "
               "| ref. compression | tokens/s | ref. tokens/s | speedup vs AR | speedup vs transformers "
               "| exact match | lowest prompt vs AR | prompts below x0.98 vs AR |")
    out.append("|" + " --- |" * 14)
    for s in rows:
        exact = "n/a" if sampled else f"{s['exact_match']}/{s['n_prompts']}"
        out.append(f"| {s['dataset']} | {s['config']} | {fmt(s['tokens_fed_per_step'])} | {s['new_tokens']} "
                   f"| {fmt(s['forward_passes'])} | {fmt(s['compression'], '.2f')} "
                   f"| {fmt(s['reference_compression'], '.2f')} | {s['tokens_per_s']:.1f} "
                   f"| {fmt(s['reference_tokens_per_s'], '.0f')} | {fmt(s['speedup_vs_ar'], '.2f')} "
                   f"| {fmt(s['speedup_vs_transformers'], '.2f')} | {exact} | {fmt(s['lowest_vs_ar'], '.2f')} "
                   f"| {fmt(s['prompts_below_x098_vs_ar'])} |")
    return out


def step_cost_table(costs: dict[int, float]) -> str:
    base = costs.get(1) or min(costs.values())
    lines = [f"\n### step cost ({STEP_COST_SOURCE})\n", "| tokens in the pass | ms per pass | relative to 1 token |",
             "| --- | --- | --- |"]
    lines += [f"| {t} | {1e3 * s:.2f} | {s / base:.2f} |" for t, s in sorted(costs.items())]
    return "\n".join(lines)


# ---- step cost -------------------------------------------------------------------------------------------------

def default_step_sizes(settings: Sequence[Setting]) -> list[int]:
    return sorted({1, 2, 4, 8, 16, 32, 64, 128} | {step_shape(s)[0] for s in settings})


def step_costs(model: Any, sizes: list[int], reps: int) -> dict[int, float]:
    """Seconds per forward pass of T tokens (every row projected: an upper bound for lookahead, which projects
    fewer), measured by the function the auto strategy itself relies on. Sizes that do not fit the model's context
    are skipped."""
    fits = [t for t in sizes if t < model.config.max_seq_len // 2]
    return {int(t): float(s) for t, s in measure_step_costs(model, fits, repeats=reps).items()} if fits else {}


# ---- the job ---------------------------------------------------------------------------------------------------

def timed_records(args: argparse.Namespace, ckpt_path: Path) -> tuple[LLM, ContendersByTemperature, list[dict]]:
    """Loads both libraries' models, warms every contender up and runs the timed loop."""
    texts = load_prompt_texts(args.data_dir, args.datasets, args.n_prompts)
    quantize = None if args.quantize == "none" else args.quantize
    llm = LLM.load(ckpt_path, dtype=args.dtype, device="cpu", quantize=quantize)
    prompts = encode_prompts(llm, texts, show_progress=not args.no_progress)
    runner = Runner(llm, None if args.no_transformers else load_hf_model(ckpt_path, args.dtype))
    histories = seeded_histories(args, llm)
    by_temperature = {t: contenders(args, t, histories) for t in dict.fromkeys(args.temperatures)}
    warm_up(runner, by_temperature, prompts, args.max_new_tokens)
    records = measure(runner, prompts, by_temperature, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                      seed=args.seed, desc="decode", show_progress=not args.no_progress)
    return llm, by_temperature, records


def seeded_histories(args: argparse.Namespace, llm: LLM) -> dict[int, DraftHistory]:
    """Per history=H of --auto, a DraftHistory holding plain greedy decoding's answers to the H prompts that follow
    the measured ones in each dataset (never a measured prompt), frozen: the timed runs draft from the same earlier
    answers in every repeat and order, as a server that has answered H requests of each kind would."""
    sizes = sorted({fields["history"] for _, fields in filter(None, args.auto) if "history" in fields})
    if not sizes:
        return {}
    texts = load_prompt_texts(args.data_dir, args.datasets, args.n_prompts + sizes[-1])
    prompts = encode_prompts(llm, {name: items[args.n_prompts:] for name, items in texts.items()},
                             show_progress=not args.no_progress)
    histories = {H: DraftHistory() for H in sizes}
    with progress(sum(map(len, prompts.values())), "history", not args.no_progress) as bar:
        for items in prompts.values():
            for i, ids in enumerate(items):
                answer = llm.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0,
                                      strategy="autoregressive").token_ids
                for H, history in histories.items():
                    if i < H:
                        history.add(answer)
                bar.update()
    for history in histories.values():
        history.frozen = True
    return histories


def run(args: argparse.Namespace, command: str, env: dict) -> dict:
    """The whole comparison; prints the tables, writes results.json and the plots, returns the document."""
    Figure = None if args.no_plots else plots.import_figure()  # missing dependencies fail before anything slow
    if not args.no_transformers:
        import_transformers()
    reference = load_reference()
    ckpt_path = resolve_checkpoint(args.ckpt)
    llm, by_temperature, records = timed_records(args, ckpt_path)
    applies = ckpt_path.name == reference.model_file and args.dtype == reference.dtype
    summary = summarize(records, by_temperature, llm.model.config, reference.figures if applies else {})
    costs = step_costs(llm.model, args.step_sizes or default_step_sizes(args.settings), args.step_reps)
    print(decode_tables(summary))
    if costs:
        print(step_cost_table(costs))
    document = dict(command=command, mode="decode", checkpoint=str(ckpt_path),
                    environment=dict(env, load_average_1m_end=load_average()), settings=options_record(args),
                    reference_figures=reference_document(reference), summary=summary,
                    step_costs={"source": STEP_COST_SOURCE, "seconds": costs}, records=records)
    write_json(args.out_dir / "results.json", document)
    if Figure is not None:
        marks = {f"({setting_text(s)})": step_shape(s)[0] for s in args.settings}
        plots.write_decode_plots(Figure, summary, costs, STEP_COST_SOURCE, marks, args.out_dir)
    return document


def main(argv: Sequence[str] | None = None) -> int:
    return run_timed_job(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
