#!/usr/bin/env python
"""Benchmark minilade's decoding strategies against plain autoregressive decoding and the transformers library.

    python scripts/benchmark.py                               # decode comparison (3 datasets x 20 prompts x 128 tokens)
    python scripts/benchmark.py --quick                       # smoke test: 1 prompt a dataset x 8 tokens, 1 setting
    python scripts/benchmark.py --settings 7,5,7 5,4,5 --temperatures 0 0.7 --n-prompts 5
    python scripts/benchmark.py ar --dtypes float32 bfloat16  # autoregressive throughput vs memory bandwidth

Modes
  decode (default)  Per dataset and configuration (minilade autoregressive, lookahead at each --settings W,N,G,
                    auto, transformers generate, transformers prompt lookup): new tokens,
                    forward passes, compression (new tokens per forward pass, prefill included), tokens per second,
                    speedups and exact matches. Also measures the step-cost curve. Writes results.json and plots.
  ar                minilade autoregressive vs transformers generate per --dtypes: tokens per second, their ratio,
                    and the weight bytes read per second next to this machine's measured memory bandwidth.
                    Writes ar_results.json.

Timing rules: machines are noisy, so every figure is a ratio measured side by side in one run. Each configuration
is warmed up first; then, for each prompt, every configuration runs in a shuffled (seeded) order, --repeats times,
and each (prompt, configuration) keeps the median wall time. A whole generate call is timed (prefill included)
for both libraries. Speedups are medians over prompts of the paired per-prompt ratio of tokens per second.

Datasets (../shared/data by default, never copied into the project): mt_bench.jsonl (turns[0], chat template),
humaneval.jsonl (prompt, raw completion), gsm8k_test.jsonl (question, chat template); the first --n-prompts of each.
transformers and matplotlib are benchmark-only dependencies: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import itertools
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from minilade import LLM, Auto, Autoregressive, Lookahead
from minilade.checkpoints import DEFAULT_CHECKPOINT, CheckpointError, resolve_checkpoint
from minilade.config import ModelConfig
from minilade.decoding.step_costs import measure_step_costs
from minilade.errors import TokenizerError, UnsupportedModelError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = (REPO_ROOT / ".." / "shared" / "data").resolve()
DEFAULT_OUT_DIR = REPO_ROOT / "bench_out"
EXIT_USAGE = 2

# name -> (file, the record's prompt, whether it goes through the chat template)
DATASETS: dict[str, tuple[str, Callable[[dict], str], bool]] = {
    "mt_bench": ("mt_bench.jsonl", lambda record: record["turns"][0], True),
    "humaneval": ("humaneval.jsonl", lambda record: record["prompt"], False),
    "gsm8k": ("gsm8k_test.jsonl", lambda record: record["question"], True),
}
DEFAULT_SETTINGS = ["7,5,7", "15,5,15", "3,3,3", "5,4,5", "1,5,3"]  # W,N,G; the last three are CPU-friendly

# NOT OUR MEASUREMENT. Figures of the published reference implementation (hao-ai-lab/LookaheadDecoding), as given
# in our issue tracker: measured on this machine with the same model (SmolLM2-135M-Instruct Q4_1), float32,
# greedy; compression = new tokens / forward passes, prefill included. Printed beside our figures, for the default
# model in float32 only, and labelled "ref." wherever they appear.
REFERENCE_PROVENANCE = ("published reference implementation (hao-ai-lab/LookaheadDecoding), measured on this "
                        "machine with the same model, float32, greedy; figures from our issue tracker")
REFERENCE_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE_FIGURES: dict[tuple[str, tuple[int, int, int]], dict[str, float]] = {
    ("mt_bench", (7, 5, 7)): {"compression": 1.64, "tokens_per_s": 15.0},
    ("mt_bench", (15, 5, 15)): {"compression": 1.70},
    ("humaneval", (7, 5, 7)): {"compression": 2.02},
    ("humaneval", (15, 5, 15)): {"compression": 2.17},
}
AR, HF_GENERATE, HF_PROMPT_LOOKUP, HF_PREFILL, AUTO = (
    "minilade AR", "transformers generate", "transformers prompt lookup", "transformers prefill", "auto")


class UsageError(Exception):
    """Bad input to the benchmark (a missing data file or dependency): one line on stderr, exit status 2."""


# ---- command line ----------------------------------------------------------------------------------------------

CPU_DTYPES = ("float32", "bfloat16")  # the benchmark runs on the CPU, where minilade has no float16
QUICK_DEFAULTS = dict(n_prompts=1, max_new_tokens=8, repeats=1, settings=["3,3,3"], step_reps=2, bandwidth_mib=64,
                      dtypes=["float32"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/benchmark.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=["decode", "ar"], default="decode")
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT, help="a .gguf file or a checkpoint folder (as the CLI)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="folder of the jsonl prompt sets")
    p.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    p.add_argument("--n-prompts", type=int, default=20, help="first N prompts of each dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=CPU_DTYPES, default="float32", help="decode mode: the weights' dtype")
    p.add_argument("--dtypes", nargs="+", choices=CPU_DTYPES, default=list(CPU_DTYPES), help="ar mode: dtypes")
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, metavar="W,N,G",
                   help=f"lookahead settings (default: {' '.join(DEFAULT_SETTINGS)})")
    p.add_argument("--auto", default="5,4,5", metavar="W,N,G",
                   help="the auto strategy's largest step; 'none' leaves the auto row out")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0],
                   help="0 = greedy (all rows); T > 0 runs the minilade rows sampled, seeded per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (prompt, configuration); median kept")
    p.add_argument("--seed", type=int, default=0, help="seeds the run order and the sampling seeds")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    p.add_argument("--no-transformers", action="store_true", help="leave out the transformers rows")
    p.add_argument("--step-sizes", nargs="+", type=int, default=None,
                   help="tokens per forward pass for the step-cost curve (default: powers of 2 and each setting's)")
    p.add_argument("--step-reps", type=int, default=5, help="timed forward passes per step size (median kept)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="ar mode: buffer size for the bandwidth test")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots (matplotlib not needed)")
    p.add_argument("--quick", action="store_true",
                   help="smoke-test defaults: " + ", ".join(f"{k}={v}" for k, v in QUICK_DEFAULTS.items()))
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """--quick changes the defaults only, so explicit flags still win."""
    parser = build_parser()
    if "--quick" in argv:
        parser.set_defaults(**QUICK_DEFAULTS)
    args = parser.parse_args(argv)
    args.settings = [parse_setting(s) for s in args.settings]
    args.auto = None if args.auto == "none" else parse_setting(args.auto)
    for name in ("n_prompts", "max_new_tokens", "repeats", "step_reps", "bandwidth_mib", "threads"):
        if name == "threads" and args.threads is None:
            continue
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(t < 0 for t in args.temperatures):
        raise UsageError(f"temperatures must be >= 0, got {args.temperatures}")
    return args


def parse_setting(text: str) -> tuple[int, int, int]:
    try:
        w, n, g = (int(x) for x in text.split(","))
        Lookahead(window=w, ngram=n, guesses=g)  # validates
    except ValueError as e:
        raise UsageError(f"bad lookahead setting {text!r}: expected W,N,G such as 7,5,7 ({e})") from None
    return w, n, g


# ---- data ------------------------------------------------------------------------------------------------------

def load_prompt_texts(data_dir: Path, names: Sequence[str], n: int) -> dict[str, list[str]]:
    """The first n prompt texts of each dataset. Every file is checked before any is read."""
    paths = {name: data_dir / DATASETS[name][0] for name in names}
    for path in paths.values():
        if not path.is_file():
            raise UsageError(f"data file not found: {path} (pass --data-dir)")
    texts = {}
    for name, path in paths.items():
        with path.open(encoding="utf-8") as f:
            records = [json.loads(line) for line in itertools.islice((l for l in f if l.strip()), n)]
        texts[name] = [DATASETS[name][1](r) for r in records]
    return texts


def encode_prompts(llm: LLM, texts: dict[str, list[str]]) -> dict[str, list[list[int]]]:
    limit = llm.model.config.max_seq_len
    prompts = {name: [llm.encode(t, chat=DATASETS[name][2]) for t in items] for name, items in texts.items()}
    for name, items in prompts.items():
        for i, ids in enumerate(items):
            if len(ids) >= limit:
                raise UsageError(f"{name} prompt {i} has {len(ids)} tokens; the model's context is {limit}")
    return prompts


# ---- configurations and single runs ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One row of the comparison: a minilade strategy or a transformers generate call."""

    label: str
    library: str                      # "minilade" or "transformers"
    strategy: Any = None              # minilade: a Strategy
    prompt_lookup: int = 0            # transformers: prompt_lookup_num_tokens (0 = plain greedy generate)
    setting: tuple[int, int, int] | None = None  # lookahead (W, N, G)
    max_new_tokens: int | None = None  # overrides the budget (transformers prefill-only timing)


def lookahead_label(setting: tuple[int, int, int]) -> str:
    return "lookahead ({},{},{})".format(*setting)


def decode_configs(args: argparse.Namespace, temperature: float) -> list[Config]:
    configs = [Config(AR, "minilade", Autoregressive())]
    configs += [Config(lookahead_label(s), "minilade", Lookahead(window=s[0], ngram=s[1], guesses=s[2]), setting=s)
                for s in args.settings]
    if args.auto:
        W, N, G = args.auto
        configs.append(Config(AUTO, "minilade", Auto(window=W, ngram=N, guesses=G)))
    if temperature == 0 and not args.no_transformers:
        configs += [Config(HF_GENERATE, "transformers"),
                    Config(HF_PROMPT_LOOKUP, "transformers", prompt_lookup=args.prompt_lookup_tokens)]
    return configs


def ar_configs() -> list[Config]:
    return [Config(AR, "minilade", Autoregressive()), Config(HF_GENERATE, "transformers"),
            Config(HF_PREFILL, "transformers", max_new_tokens=1)]


@dataclass
class Run:
    new_ids: list[int]
    wall_s: float
    forward_passes: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    finish_reason: str = ""
    tokens_per_step: dict[int, int] = field(default_factory=dict)


class Runner:
    """Runs one configuration on one prompt and times the whole generate call."""

    def __init__(self, llm: LLM, hf_model: Any) -> None:
        self.llm, self.hf_model = llm, hf_model
        self.eos_ids = list(llm.tokenizer.eos_ids)

    def __call__(self, cfg: Config, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
        budget = cfg.max_new_tokens or max_new_tokens
        if cfg.library == "minilade":
            return self._minilade(cfg, ids, budget, temperature, seed)
        return self._transformers(cfg, ids, budget)

    def _minilade(self, cfg: Config, ids: list[int], budget: int, temperature: float, seed: int) -> Run:
        start = time.perf_counter()
        out = self.llm.generate(ids, max_new_tokens=budget, strategy=cfg.strategy, temperature=temperature,
                                seed=seed if temperature > 0 else None)
        wall = time.perf_counter() - start
        s = out.stats
        return Run(out.token_ids, wall, s.forward_passes, s.prefill_s, s.decode_s, out.finish_reason,
                   {int(k): v for k, v in sorted(s.tokens_per_step.items())})

    def _transformers(self, cfg: Config, ids: list[int], budget: int) -> Run:
        extra = {"prompt_lookup_num_tokens": cfg.prompt_lookup} if cfg.prompt_lookup else {}
        eos = self.eos_ids
        with torch.inference_mode():
            start = time.perf_counter()
            input_ids = torch.tensor([ids])
            out = self.hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=budget,
                                         do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None,
                                         **extra)
            wall = time.perf_counter() - start
        new = out[0, len(ids):].tolist()
        return Run(new, wall, finish_reason="eos" if new and new[-1] in eos else "length")


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UsageError('transformers is not installed: pip install -e ".[bench]" (or pass --no-transformers)') \
            from None
    transformers.logging.set_verbosity_error()
    return transformers


def load_hf_model(ckpt_path: Path, dtype: str) -> Any:
    """The same checkpoint in transformers: a .gguf file (dequantised by transformers) or a folder."""
    transformers = import_transformers()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    auto = transformers.AutoModelForCausalLM
    if ckpt_path.suffix == ".gguf":
        model = auto.from_pretrained(ckpt_path.parent, gguf_file=ckpt_path.name, dtype=torch_dtype)
    else:
        model = auto.from_pretrained(ckpt_path, dtype=torch_dtype)
    return model.eval()


# ---- the timed loop --------------------------------------------------------------------------------------------

def ids_hash(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def sample_seed(base: int, dataset: str, prompt_index: int) -> int:
    """The sampling seed of one prompt, the same for every configuration and repetition."""
    return base + 10_000 * list(DATASETS).index(dataset) + prompt_index


def warm_up(runner: Runner, configs_by_temp: dict[float, list[Config]], prompts: dict[str, list[list[int]]],
            max_new_tokens: int) -> None:
    """One untimed run of every configuration on the longest prompt (allocates caches, fills kernel caches)."""
    longest = max((ids for items in prompts.values() for ids in items), key=len)
    for temperature, configs in configs_by_temp.items():
        for cfg in configs:
            runner(cfg, longest, min(16, max_new_tokens), temperature, seed=0)


def measure(runner: Runner, prompts: dict[str, list[list[int]]], configs_by_temp: dict[float, list[Config]],
            args: argparse.Namespace, desc: str) -> list[dict]:
    """For each prompt and temperature, every configuration in a shuffled order, --repeats times. One record a run."""
    rng = random.Random(args.seed)
    per_prompt = sum(len(c) for c in configs_by_temp.values()) * args.repeats
    total = per_prompt * sum(len(items) for items in prompts.values())
    records = []
    with tqdm(total=total, desc=desc, unit="run", disable=args.no_progress, file=sys.stderr) as bar:
        for dataset, items in prompts.items():
            for i, ids in enumerate(items):
                for temperature, configs in configs_by_temp.items():
                    seed = sample_seed(args.seed, dataset, i)
                    for rep in range(args.repeats):
                        for cfg in rng.sample(configs, len(configs)):
                            bar.set_postfix_str(f"{dataset} #{i} {cfg.label}", refresh=False)
                            run = runner(cfg, ids, args.max_new_tokens, temperature, seed)
                            records.append(make_record(dataset, i, temperature, cfg, rep, len(ids), seed, run))
                            bar.update()
    return records


def make_record(dataset: str, prompt: int, temperature: float, cfg: Config, rep: int, prompt_tokens: int,
                seed: int, run: Run) -> dict:
    return dict(dataset=dataset, prompt=prompt, temperature=temperature, config=cfg.label, rep=rep,
                prompt_tokens=prompt_tokens, seed=seed if temperature > 0 else None, new_tokens=len(run.new_ids),
                forward_passes=run.forward_passes, wall_s=run.wall_s, prefill_s=run.prefill_s,
                decode_s=run.decode_s, finish_reason=run.finish_reason, tokens_per_step=run.tokens_per_step,
                ids_sha1=ids_hash(run.new_ids), token_ids=run.new_ids)


# ---- summaries -------------------------------------------------------------------------------------------------

@dataclass
class PromptResult:
    """One (prompt, configuration): medians over the repetitions; tokens from the first repetition."""

    new_tokens: int
    forward_passes: int | None
    wall_s: float
    decode_s: float | None
    ids: list[int]
    reps_agree: bool  # every repetition produced the same tokens

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s


def group_by_prompt(records: list[dict]) -> dict[tuple, dict[int, PromptResult]]:
    """(dataset, temperature, config) -> prompt index -> PromptResult."""
    runs: dict[tuple, dict[int, list[dict]]] = {}
    for r in records:
        runs.setdefault((r["dataset"], r["temperature"], r["config"]), {}).setdefault(r["prompt"], []).append(r)
    grouped = {}
    for key, by_prompt in runs.items():
        grouped[key] = {}
        for prompt, reps in by_prompt.items():
            first = min(reps, key=lambda r: r["rep"])
            decode = [r["decode_s"] for r in reps if r["decode_s"] is not None]
            grouped[key][prompt] = PromptResult(
                first["new_tokens"], first["forward_passes"], statistics.median(r["wall_s"] for r in reps),
                statistics.median(decode) if decode else None, first["token_ids"],
                len({r["ids_sha1"] for r in reps}) == 1)
    return grouped


def paired_speedup(rows: dict[Any, PromptResult], base: dict[Any, PromptResult] | None) -> float | None:
    """Median over prompts of tokens/s(row) / tokens/s(base), which is the time ratio when both emit the same
    tokens (greedy) and stays fair when they do not (sampling, or a library that stops elsewhere)."""
    if not base:
        return None
    ratios = [rows[p].tokens_per_s / base[p].tokens_per_s for p in rows if p in base]
    return statistics.median(ratios) if ratios else None


def exact_matches(rows: dict[Any, PromptResult], base: dict[Any, PromptResult] | None) -> int | None:
    if not base:
        return None
    return sum(rows[p].ids == base[p].ids for p in rows if p in base)


def summarize_decode(records: list[dict], configs_by_temp: dict[float, list[Config]], model_config: ModelConfig,
                     with_reference: bool) -> list[dict]:
    grouped = group_by_prompt(records)
    summary = []
    for (dataset, temperature, label), rows in grouped.items():
        cfg = next(c for c in configs_by_temp[temperature] if c.label == label)
        ar, hf = grouped.get((dataset, temperature, AR)), grouped.get((dataset, temperature, HF_GENERATE))
        passes = [r.forward_passes for r in rows.values()]
        new = sum(r.new_tokens for r in rows.values())
        fed, projected = step_shape(cfg.setting) if cfg.setting or label == AR else (None, None)
        reference = REFERENCE_FIGURES.get((dataset, cfg.setting), {}) if with_reference and temperature == 0 else {}
        summary.append(dict(
            dataset=dataset, temperature=temperature, config=label, setting=cfg.setting, n_prompts=len(rows),
            new_tokens=new, forward_passes=sum(passes) if None not in passes else None,
            compression=new / sum(passes) if None not in passes else None,
            tokens_per_s=new / sum(r.wall_s for r in rows.values()),
            speedup_vs_ar=paired_speedup(rows, ar), speedup_vs_transformers=paired_speedup(rows, hf),
            exact_match=exact_matches(rows, ar) if temperature == 0 else None,
            reps_agree=all(r.reps_agree for r in rows.values()),
            tokens_fed_per_step=fed, flops_per_step=flops_per_step(model_config, fed, projected) if fed else None,
            reference_compression=reference.get("compression"), reference_tokens_per_s=reference.get("tokens_per_s")))
    labels = dict.fromkeys(c.label for cs in configs_by_temp.values() for c in cs)  # first appearance wins
    order = {label: i for i, label in enumerate(labels)}
    return sorted(summary, key=lambda s: (s["temperature"], list(DATASETS).index(s["dataset"]), order[s["config"]]))


def step_shape(setting: tuple[int, int, int] | None) -> tuple[int, int]:
    """(tokens fed, rows projected to the vocabulary) of one step with all G candidates (see minilade/masks.py and
    LookaheadDecoder._forward_and_verify): (W + G)(N - 1) tokens; the input token (when N > 2), the newest level
    (W rows) and the G(N - 1) candidate rows are projected. Autoregressive (setting None): 1 and 1."""
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


# ---- tables ----------------------------------------------------------------------------------------------------

def fmt(value: Any, spec: str = "") -> str:
    return "" if value is None else format(value, spec)


def decode_tables(summary: list[dict]) -> str:
    out = []
    for temperature in sorted({s["temperature"] for s in summary}):
        sampled = temperature > 0
        out.append(f"\n### {'greedy' if not sampled else f'sampled, temperature {temperature:g}'}\n")
        if sampled:
            out.append("Exact match is not meaningful when sampling (lookahead keeps the distribution, not the "
                       "samples), so it is not reported; speedups are against minilade AR sampling at the same "
                       "temperature.\n")
        out.append("| dataset | configuration | tokens fed/step | new tokens | forward passes | compression "
                   "| ref. compression | tokens/s | ref. tokens/s | speedup vs AR | speedup vs transformers "
                   "| exact match |")
        out.append("|" + " --- |" * 12)
        for s in (s for s in summary if s["temperature"] == temperature):
            exact = "n/a" if sampled else f"{s['exact_match']}/{s['n_prompts']}"
            out.append(f"| {s['dataset']} | {s['config']} | {fmt(s['tokens_fed_per_step'])} | {s['new_tokens']} "
                       f"| {fmt(s['forward_passes'])} | {fmt(s['compression'], '.2f')} "
                       f"| {fmt(s['reference_compression'], '.2f')} | {s['tokens_per_s']:.1f} "
                       f"| {fmt(s['reference_tokens_per_s'], '.0f')} | {fmt(s['speedup_vs_ar'], '.2f')} "
                       f"| {fmt(s['speedup_vs_transformers'], '.2f')} | {exact} |")
    if any(s["reference_compression"] for s in summary):
        out.append("\nref. = the published reference implementation on this machine, same model, float32 (figures "
                   "from our issue tracker, not measured by this run).")
    if not all(s["reps_agree"] for s in summary if s["temperature"] == 0):
        out.append("\nWARNING: some greedy repetitions produced different tokens (see reps_agree in results.json).")
    return "\n".join(out)


def step_cost_table(costs: dict[int, float], source: str) -> str:
    base = costs.get(1) or min(costs.values())
    lines = [f"\n### step cost ({source})\n", "| tokens in the pass | ms per pass | relative to 1 token |",
             "| --- | --- | --- |"]
    lines += [f"| {t} | {1e3 * s:.2f} | {s / base:.2f} |" for t, s in sorted(costs.items())]
    return "\n".join(lines)


# ---- step cost -------------------------------------------------------------------------------------------------

def default_step_sizes(settings: Sequence[tuple[int, int, int]]) -> list[int]:
    return sorted({1, 2, 4, 8, 16, 32, 64, 128} | {step_shape(s)[0] for s in settings})


def step_costs(model: Any, sizes: list[int], reps: int) -> dict[int, float]:
    """Seconds per forward pass of T tokens (every row projected: an upper bound for lookahead, which projects
    fewer), measured by minilade.decoding.step_costs.measure_step_costs, the function the auto strategy itself relies on.
    Sizes that do not fit the model's context are skipped."""
    fits = [t for t in sizes if t < model.config.max_seq_len // 2]
    return {int(t): float(s) for t, s in measure_step_costs(model, fits, repeats=reps).items()} if fits else {}


# ---- ar mode: throughput against memory bandwidth --------------------------------------------------------------

def measure_bandwidth(mib: int, reps: int = 5) -> dict[str, float]:
    """This machine's memory bandwidth in GB/s (1e9 bytes/s), median of reps after a warm-up: reading a buffer
    (torch sum) and copying it (read + write, both counted)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4

    def median_time(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    read = nbytes / median_time(src.sum) / 1e9
    copy = 2 * nbytes / median_time(lambda: dst.copy_(src)) / 1e9
    return {"buffer_mib": mib, "read_gb_s": read, "copy_gb_s": copy}


def weight_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """Bytes of weights one decode step reads: every parameter except the input embedding table (a decode step
    looks up one row of it); the output head is read whole, so a tied embedding counts once, as the head."""
    itemsize = {"float32": 4, "bfloat16": 2}[dtype]
    untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.dim
    return (config.n_params - untied_embedding) * itemsize


def summarize_ar(records: list[dict], dtype: str, config: ModelConfig, bandwidth: dict[str, float]) -> list[dict]:
    """One row per library: end-to-end and decode-only tokens/s, minilade's paired speedup over transformers, and
    the weight bytes read per second during decoding. Decode-only: minilade's own prefill/decode split; for
    transformers, each prompt's wall time minus its median prefill-only (max_new_tokens=1) time."""
    grouped = group_by_prompt(records)

    def pooled(label: str) -> dict[tuple[str, int], PromptResult]:
        """One configuration's results over every dataset, keyed by (dataset, prompt)."""
        return {(d, p): r for (d, _, c), by_prompt in grouped.items() if c == label for p, r in by_prompt.items()}

    ours, theirs, prefill = pooled(AR), pooled(HF_GENERATE), pooled(HF_PREFILL)
    ours_decode_s = sum(r.decode_s for r in ours.values())
    rows = [ar_row(dtype, AR, ours, ours_decode_s, config, bandwidth)]
    rows[0]["minilade_over_transformers"] = paired_speedup(ours, theirs)
    if theirs:
        theirs_decode_s = sum(r.wall_s - prefill[p].wall_s for p, r in theirs.items())
        rows.append(ar_row(dtype, HF_GENERATE, theirs, theirs_decode_s, config, bandwidth))
        rows[-1]["exact_match"] = exact_matches(theirs, ours)
    return rows


def ar_row(dtype: str, label: str, results: dict[Any, PromptResult], decode_s: float, config: ModelConfig,
           bandwidth: dict[str, float]) -> dict:
    new_tokens = sum(r.new_tokens for r in results.values())
    decode_tps = (new_tokens - len(results)) / decode_s if decode_s > 0 else None  # the first token is the prefill's
    weight_bytes = weight_bytes_per_token(config, dtype)
    return dict(dtype=dtype, library=label, n_prompts=len(results), new_tokens=new_tokens,
                tokens_per_s=new_tokens / sum(r.wall_s for r in results.values()), decode_tokens_per_s=decode_tps,
                minilade_over_transformers=None, exact_match=None, weight_bytes_per_token=weight_bytes,
                weight_gb_s=weight_bytes * decode_tps / 1e9 if decode_tps else None,
                measured_read_gb_s=bandwidth["read_gb_s"])


def ar_table(rows: list[dict], bandwidth: dict[str, float]) -> str:
    lines = [f"\nmemory bandwidth, measured on a {bandwidth['buffer_mib']} MiB buffer: "
             f"read {bandwidth['read_gb_s']:.1f} GB/s, copy (read + write) {bandwidth['copy_gb_s']:.1f} GB/s\n",
             "| dtype | library | new tokens | tokens/s | decode tokens/s | minilade / transformers "
             "| weight MB/token | weight GB/s | of read bandwidth | exact match |", "|" + " --- |" * 10]
    for r in rows:
        share = f"{r['weight_gb_s'] / r['measured_read_gb_s']:.0%}" if r["weight_gb_s"] else ""
        exact = "" if r["exact_match"] is None else f"{r['exact_match']}/{r['n_prompts']}"
        lines.append(f"| {r['dtype']} | {r['library']} | {r['new_tokens']} | {r['tokens_per_s']:.1f} "
                     f"| {fmt(r['decode_tokens_per_s'], '.1f')} | {fmt(r['minilade_over_transformers'], '.2f')} "
                     f"| {r['weight_bytes_per_token'] / 1e6:.0f} | {fmt(r['weight_gb_s'], '.2f')} | {share} "
                     f"| {exact} |")
    return "\n".join(lines)


# ---- plots -----------------------------------------------------------------------------------------------------

def import_figure() -> Any:
    """matplotlib's Figure class: figures built and saved without pyplot's global state or a display."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError('matplotlib is not installed: pip install -e ".[bench]"') from None
    return Figure


def plot_speedups(Figure: Any, summary: list[dict], path: Path) -> None:
    """(a) Speedup vs minilade AR per dataset (groups) and configuration (bars), one panel per temperature."""
    temperatures = sorted({s["temperature"] for s in summary})
    fig = Figure(figsize=(7 * len(temperatures), 4.5))
    axes = fig.subplots(1, len(temperatures), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        rows = [s for s in summary if s["temperature"] == temperature and s["config"] != AR]
        datasets = list(dict.fromkeys(s["dataset"] for s in rows))
        labels = list(dict.fromkeys(s["config"] for s in rows))
        width = 0.8 / max(1, len(labels))
        for j, label in enumerate(labels):
            values = {s["dataset"]: s["speedup_vs_ar"] for s in rows if s["config"] == label}
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(datasets))]
            ax.bar(xs, [values.get(d) or 0 for d in datasets], width, label=label)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_ylabel("speedup vs minilade AR (median paired ratio)")
        ax.set_title("greedy" if temperature == 0 else f"sampled, T={temperature:g}")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_compression_vs_flops(Figure: Any, summary: list[dict], path: Path) -> None:
    """(b) Tokens emitted per forward pass (compression) against FLOPs per step, one line per dataset and
    temperature, one point per lookahead setting; autoregressive decoding is the point at 1 token per pass."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    rows = [s for s in summary if s["flops_per_step"] and s["compression"]]
    for dataset, temperature in dict.fromkeys((s["dataset"], s["temperature"]) for s in rows):
        points = sorted((s for s in rows if s["dataset"] == dataset and s["temperature"] == temperature),
                        key=lambda s: s["flops_per_step"])
        label = dataset if temperature == 0 else f"{dataset}, T={temperature:g}"
        ax.plot([s["flops_per_step"] for s in points], [s["compression"] for s in points], marker="o",
                linewidth=0.8, label=label)
        for s in points:
            name = "AR" if s["setting"] is None else "({},{},{})".format(*s["setting"])
            ax.annotate(name, (s["flops_per_step"], s["compression"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per step (weight matmuls, all G candidates)")
    ax.set_title("FLOPs = 2 x non-embedding params x (W+G)(N-1) + 2 x vocab x dim x rows projected", fontsize=8)
    ax.set_ylabel("tokens per forward pass (compression)")
    ax.legend()
    save_figure(fig, path)


def plot_step_costs(Figure: Any, costs: dict[int, float], source: str, settings: Sequence[tuple[int, int, int]],
                    path: Path) -> None:
    """(c) Seconds per forward pass against tokens in the pass, relative to one token; lookahead settings marked."""
    base = costs.get(1) or min(costs.values())
    sizes = sorted(costs)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    ax.plot(sizes, [costs[t] / base for t in sizes], marker="o")
    for s in settings:
        fed = step_shape(s)[0]
        if fed in costs:
            ax.annotate("({},{},{})".format(*s), (fed, costs[fed] / base), fontsize=7, xytext=(-12, 8),
                        textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xscale("log", base=2)
    ticks = [t for t in sizes if t & (t - 1) == 0]  # powers of two: the settings' own sizes are annotated
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("tokens in the forward pass")
    ax.set_ylabel("time per pass / time of a 1-token pass")
    ax.set_title(f"step cost ({source})")
    save_figure(fig, path)


# ---- output files ----------------------------------------------------------------------------------------------

def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same folder and rename it into place, so a crash never leaves a
    half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: Path, document: dict) -> None:
    """Compact (no indentation): the records hold every run's token ids."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(document, default=str) + "\n"))


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def environment() -> dict:
    """Where and on what the benchmark ran (taken at the start; the end adds its load average)."""
    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = next((line.split(":", 1)[1].strip() for line in open_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return dict(python=platform.python_version(), torch=torch.__version__, transformers=version("transformers"),
                threads=torch.get_num_threads(), cpu=cpu, cores=os.cpu_count(), load_average_1m_start=load_average(),
                platform=platform.platform(), git_commit=git("rev-parse", "HEAD"),
                git_dirty=bool(git("status", "--porcelain")), time=time.strftime("%Y-%m-%d %H:%M:%S %z"))


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def open_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def settings_dict(args: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


# ---- the two modes ---------------------------------------------------------------------------------------------

def run_decode(args: argparse.Namespace, command: str) -> dict:
    env = environment()
    Figure = None if args.no_plots else import_figure()  # missing dependencies fail before anything slow
    if not args.no_transformers:
        import_transformers()
    texts = load_prompt_texts(args.data_dir, args.datasets, args.n_prompts)
    ckpt_path = resolve_checkpoint(args.ckpt)
    llm = LLM.load(ckpt_path, dtype=args.dtype, device="cpu")
    prompts = encode_prompts(llm, texts)
    hf_model = None if args.no_transformers else load_hf_model(ckpt_path, args.dtype)
    runner = Runner(llm, hf_model)
    configs_by_temp = {t: decode_configs(args, t) for t in dict.fromkeys(args.temperatures)}
    warm_up(runner, configs_by_temp, prompts, args.max_new_tokens)
    records = measure(runner, prompts, configs_by_temp, args, desc="decode")
    with_reference = ckpt_path.name == REFERENCE_MODEL_FILE and args.dtype == "float32"
    summary = summarize_decode(records, configs_by_temp, llm.model.config, with_reference)
    sizes = args.step_sizes or default_step_sizes(args.settings)
    costs, source = step_costs(llm.model, sizes, args.step_reps), "minilade.decoding.step_costs.measure_step_costs"
    print(decode_tables(summary))
    if costs:
        print(step_cost_table(costs, source))
    document = dict(command=command, mode="decode", checkpoint=str(ckpt_path), 
                    environment=dict(env, load_average_1m_end=load_average()), settings=settings_dict(args),
                    reference_figures=reference_document(), summary=summary,
                    step_costs={"source": source, "seconds": costs}, records=records)
    write_json(args.out_dir / "results.json", document)
    if Figure is not None:
        write_decode_plots(Figure, summary, costs, source, args.settings, args.out_dir)
    return document


def reference_document() -> dict:
    return {"provenance": REFERENCE_PROVENANCE, "not_measured_by_this_run": True,
            "figures": [dict(dataset=d, setting=s, **f) for (d, s), f in REFERENCE_FIGURES.items()]}


def write_decode_plots(Figure: Any, summary: list[dict], costs: dict[int, float], source: str,
                       settings: Sequence[tuple[int, int, int]], out: Path) -> None:
    plot_speedups(Figure, summary, out / "speedup.png")
    plot_compression_vs_flops(Figure, summary, out / "compression_vs_flops.png")
    if costs:
        plot_step_costs(Figure, costs, source, settings, out / "step_cost.png")


def run_ar(args: argparse.Namespace, command: str) -> dict:
    env = environment()
    if not args.no_transformers:
        import_transformers()
    texts = load_prompt_texts(args.data_dir, args.datasets, args.n_prompts)
    ckpt_path = resolve_checkpoint(args.ckpt)
    bandwidth = measure_bandwidth(args.bandwidth_mib)
    rows, records = [], []
    for dtype in args.dtypes:
        llm = LLM.load(ckpt_path, dtype=dtype, device="cpu")
        prompts = encode_prompts(llm, texts)
        hf_model = None if args.no_transformers else load_hf_model(ckpt_path, dtype)
        runner = Runner(llm, hf_model)
        configs = {0.0: ar_configs()[:1] if args.no_transformers else ar_configs()}
        warm_up(runner, configs, prompts, args.max_new_tokens)
        dtype_records = measure(runner, prompts, configs, args, desc=f"ar {dtype}")
        rows += summarize_ar(dtype_records, dtype, llm.model.config, bandwidth)
        records += [dict(r, dtype=dtype) for r in dtype_records]
        del llm, hf_model, runner
    print(ar_table(rows, bandwidth))
    document = dict(command=command, mode="ar", checkpoint=str(ckpt_path),
                    environment=dict(env, load_average_1m_end=load_average()), settings=settings_dict(args),
                    bandwidth=bandwidth, summary=rows, records=records)
    write_json(args.out_dir / "ar_results.json", document)
    return document


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", os.path.relpath(__file__), *argv])
    try:
        args = parse_args(argv)
        if args.threads:
            torch.set_num_threads(args.threads)
        print(f"command: {command}", flush=True)
        print(f"machine: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, load average "
              f"{fmt(load_average(), '.2f')} at start (other work on the machine skews absolute figures, "
              f"less so the ratios)", flush=True)
        if args.mode == "ar":
            run_ar(args, command)
        else:
            run_decode(args, command)
    except (UsageError, CheckpointError, TokenizerError, UnsupportedModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    print(f"\nwrote {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
