"""Weight-only quantization (minilade/quant.py): speed, memory, exactness and quality, side by side in one run.

    python -m scripts.bench.quant                     # every part
    python -m scripts.bench.quant --parts layers decode --quick

Parts (--parts):
  layers   per-layer matmul milliseconds at 1..64 rows on SmolLM2-135M's shapes: dense float32 / bfloat16, int8,
           int4 (group 32 and 64; 576 columns rule out 128), int4 dequantized on the fly into a float32 matmul,
           w7a8 (integer_linear.py); kernels interleaved (quant_layers.py).
  decode   plain (autoregressive) decoding of the real model: float32 against int8 / int4 with float32 or
           bfloat16 models around the quantized layers, and w7a8; decode tokens/s (medians of interleaved repeats),
           weight bytes, and whether lookahead's greedy output equals plain decoding's under the same weights;
           with --compiled, also those contenders' plain decoding through compiled steps (minilade/compiled.py),
           and whether greedy lookahead equals plain decoding through them.
  steps    what a forward pass of T rows costs (minilade's step-cost measurement) for float32, int4 with one
           kernel per layer (exact), w7a8 and int4 with a kept dense copy from --dense-from rows on (inexact).
  7b       a llama-7b-shaped model with random int4 weights (groups of --big-group) and an int8 embedding, built
           layer by layer without a float copy: memory and decode tokens/s.
  ppl      perplexity of the real model's float32 weights (its Q4_1 blocks dequantized) against int8, int4, w7a8 on
           the first --ppl-prompts HumanEval prompts concatenated.
Writes quant_results.json to --out-dir.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minilade import LLM
from minilade.checkpoints import DEFAULT_CHECKPOINT, open_checkpoint
from minilade.checkpoints.checkpoint import Checkpoint
from minilade.compiled import compile_steps
from minilade.config import ModelConfig
from minilade.decoding import Autoregressive, GenerationSettings, GenerationStats, Lookahead, TokenRun, decode_tokens
from minilade.decoding.step_costs import measure_step_costs
from minilade.device import make_exact
from minilade.loading import gguf_codes
from minilade.model import Transformer
from minilade.quant import (
    GROUP_SIZES,
    Int4Weight,
    Int8GroupWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    linear_modules,
    quantize_embedding,
    quantize_linears,
    weight_bytes,
)
from minilade.sampling import SamplingParams

from .common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    JobParser,
    begin_timed_run,
    command_line,
    load_prompt_texts,
    options_record,
    parse_with_quick,
    positive_int,
    run_job,
    write_json,
)
from .llama_cpp import llama_cpp_peer
from .quant_layers import LAYER_ROWS, print_table, run_layers

MODULE = "scripts.bench.quant"
PARTS = ("layers", "decode", "steps", "7b", "ppl")
QUICK = dict(repeats=1, n_prompts=1, max_new_tokens=8, ppl_prompts=2, layer_repeats=3, big_tokens=2)
MB = 1e6


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = JobParser(MODULE, __doc__)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--n-prompts", type=positive_int, default=3, help="HumanEval prompts for decode")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--layer-repeats", type=positive_int, default=15)
    p.add_argument("--dense-from", type=positive_int, default=16, help="rows from which the mixed mode goes dense")
    p.add_argument("--compiled", nargs="*", default=[], choices=("float32", "bfloat16", "int8", "int4"),
                   help="decode: also time these contenders with compiled one-token steps (minilade.compiled)")
    p.add_argument("--ppl-prompts", type=positive_int, default=20)
    p.add_argument("--big-tokens", type=positive_int, default=8, help="tokens decoded by the 7B model")
    p.add_argument("--big-group", type=int, choices=GROUP_SIZES, default=32, help="int4 group of the 7B model")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--quick", action="store_true", help=f"smoke-test defaults: {QUICK}")
    return parse_with_quick(p, argv, QUICK)


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(job, argv)


def job(argv: list[str]) -> int:
    args = parse_args(argv)
    command = command_line(MODULE, argv)
    env = begin_timed_run(command, args.threads)
    results: dict[str, Any] = dict(command=command, environment=env, options=options_record(args))
    torch.manual_seed(args.seed)
    with torch.inference_mode():
        for part in args.parts:
            print(f"\n== {part}", flush=True)
            results[part] = PART_RUNNERS[part](args)
    results["llama_cpp"] = peer = llama_cpp_peer(args.ckpt, torch.get_num_threads(), args.max_new_tokens)
    print(f"\nllama.cpp peer ({peer['status']}): {peer['note']}" + (
        f"; {peer['tokens_per_s']:.1f} tokens/s" if peer["tokens_per_s"] else ""))
    if peer["tokens_per_s"] and "decode" in results:
        results["vs_llama_cpp"] = {name: row["tokens_per_s"] / peer["tokens_per_s"]
                                   for name, row in results["decode"]["table"].items()}
        print("plain decoding / llama.cpp:", ", ".join(f"{k} x{v:.2f}" for k, v in results["vs_llama_cpp"].items()))
    write_json(args.out_dir / "quant_results.json", results, indent=1)
    print(f"wrote {args.out_dir / 'quant_results.json'}", file=sys.stderr)
    return 0


# ---- the real model in each variant ------------------------------------------------------------------------------

def variants(llm: LLM, checkpoint: Checkpoint, dense_from: int | None = None) -> dict[str, Transformer]:
    """The decode contenders, all from one float32 load: the float model itself, a bfloat16 copy, and int8 /
    int4 copies with float32 or bfloat16 around the quantized layers, quantized as LLM.load quantizes (the
    embedding in int8 groups; int4 takes the file's 4-bit blocks where they map: all Q4_0 / Q4_1 tensors, the tied
    Q8_0 head quantized from its float weights; a Q8_0 embedding taken code for code)."""
    models = {"float32": llm.model, "bfloat16": to_dtype(copy.deepcopy(llm.model), torch.bfloat16)}
    for mode in ("int8", "int4"):
        models[mode] = quantized = quantized_copy(llm, checkpoint, mode, 32)
        models[f"{mode} bf16 model"] = to_dtype(copy.deepcopy(quantized), torch.bfloat16)
    models["w7a8"] = quantized_copy(llm, checkpoint, "w7a8", 32)
    if dense_from is not None:
        models[f"int4 dense>={dense_from}"] = quantized_copy(llm, checkpoint, "int4", 32, dense_from_rows=dense_from)
    return {name: as_loaded(model) for name, model in models.items()}


def quantized_copy(llm: LLM, checkpoint: Checkpoint, mode: str, group_size: int, **options: Any) -> Transformer:
    """A copy of the float model quantized as LLM.load(quantize=mode) quantizes it: linear layers, then the
    embedding, taking the file's own codes where they map exactly."""
    model = copy.deepcopy(llm.model)
    blocks = gguf_codes(checkpoint, model, llm.tokenizer.vocab_size, mode, group_size)
    quantize_linears(model, mode, group_size, weights=blocks, **options)
    return quantize_embedding(model, blocks.get("tok_embeddings"))


def as_loaded(model: Transformer) -> Transformer:
    """The model on the path LLM.load runs: batch-invariant steps, float layers in their row tilings."""
    make_exact(model, warn=False)
    return model


def to_dtype(model: Transformer, dtype: torch.dtype) -> Transformer:
    """The model's float tensors in dtype (a quantized layer's scales included, which already are bfloat16)."""
    model.to(dtype)
    model.setup_rope()
    return model


def generate(model: Transformer, ids: list[int], strategy: Any, max_new_tokens: int
             ) -> tuple[list[int], GenerationStats]:
    run = TokenRun(GenerationStats())
    settings = GenerationSettings(strategy, SamplingParams(), max_new_tokens)
    tokens = list(decode_tokens(model, ids, run, settings))
    return tokens, run.stats


def humaneval_ids(llm: LLM, args: argparse.Namespace, n: int) -> list[list[int]]:
    texts = load_prompt_texts(args.data_dir, ["humaneval"], n)["humaneval"]
    return [llm.encode(text, chat=False) for text in texts]


def load_real(args: argparse.Namespace) -> tuple[LLM, Checkpoint]:
    # Plain layers that copy.deepcopy can copy (prepacked ones cannot); variants() then makes each copy
    # batch-invariant, as LLM.load does.
    llm = LLM.load(args.ckpt, dtype="float32", progress=False, exact=False, compile=False)
    return llm, open_checkpoint(args.ckpt, progress=False)


# ---- decode ------------------------------------------------------------------------------------------------------

def run_decode(args: argparse.Namespace) -> dict:
    """Plain decoding, every contender on every prompt in a shuffled order per repeat; decode tokens/s is steps
    over decoding seconds (prefill excluded), median over repeats, then over prompts; speedups are medians of the
    per-prompt ratios to float32."""
    llm, checkpoint = load_real(args)
    models = variants(llm, checkpoint, args.dense_from)
    # one-row steps never reach a dense copy
    timed = {name: (models[name], Autoregressive()) for name in models if "dense" not in name}
    compiled = {f"{name} compiled": compile_steps(copy.deepcopy(models[name])) for name in args.compiled}
    timed.update({name: (model, Autoregressive()) for name, model in compiled.items()})
    prompts = humaneval_ids(llm, args, args.n_prompts)
    rng = random.Random(args.seed)
    for name, (model, strategy) in timed.items():  # warm-up (and compilation)
        generate(model, prompts[0], strategy, 8)
    rate: dict[str, list[float]] = {name: [] for name in timed}
    for ids in prompts:
        samples: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(args.repeats):
            for name in rng.sample(list(timed), len(timed)):
                model, strategy = timed[name]
                _, stats = generate(model, ids, strategy, args.max_new_tokens)
                samples[name].append(stats.steps / stats.decode_s)
        for name in timed:
            rate[name].append(statistics.median(samples[name]))
    table = {name: dict(tokens_per_s=statistics.median(rate[name]),
                        vs_float32=statistics.median(r / f for r, f in zip(rate[name], rate["float32"])),
                        weight_mb=weight_bytes(model) / MB) for name, (model, _) in timed.items()}
    print_table(f"plain decoding, {len(prompts)} HumanEval prompts x {args.max_new_tokens} tokens, "
                f"{args.repeats} repeats", table, ".2f")
    return dict(table=table,
                exact=agreement("greedy lookahead (7,5,7) == plain decoding", models,
                                Lookahead(window=7, ngram=5, guesses=7), prompts, args.max_new_tokens),
                compiled_exact=agreement("greedy lookahead (7,5,7) == plain decoding, both compiled", compiled,
                                         Lookahead(window=7, ngram=5, guesses=7), prompts, args.max_new_tokens))


def agreement(title: str, models: dict[str, Transformer], strategy: Any, prompts: list[list[int]],
              max_new_tokens: int) -> dict[str, str]:
    """On how many prompts each model's greedy output under `strategy` is identical to plain decoding's."""
    counts = {}
    for name, model in models.items():
        same = sum(generate(model, ids, strategy, max_new_tokens)[0]
                   == generate(model, ids, Autoregressive(), max_new_tokens)[0] for ids in prompts)
        counts[name] = f"{same}/{len(prompts)}"
    if counts:
        print(f"{title}:", ", ".join(f"{k} {v}" for k, v in counts.items()))
    return counts


# ---- steps -------------------------------------------------------------------------------------------------------

def run_steps(args: argparse.Namespace) -> dict:
    """Milliseconds of one forward pass of T rows after 256 committed tokens (decoding.step_costs), for the
    float32 model as LLM.load runs it (batch-invariant), int4 exact, w7a8 and int4 with a dense copy."""
    llm, checkpoint = load_real(args)
    models = {"float32": as_loaded(copy.deepcopy(llm.model)),
              "int4": as_loaded(quantized_copy(llm, checkpoint, "int4", 32)),
              "w7a8": as_loaded(quantized_copy(llm, checkpoint, "w7a8", 32)),
              f"int4 dense>={args.dense_from}": as_loaded(quantized_copy(llm, checkpoint, "int4", 32,
                                                                         dense_from_rows=args.dense_from))}
    costs = {name: measure_step_costs(model, LAYER_ROWS, context=256, repeats=args.repeats)
             for name, model in models.items()}
    table = {f"T={T}": {name: 1e3 * costs[name][T] for name in models} for T in LAYER_ROWS}
    print_table("ms per forward pass of T rows", table, ".1f")
    memory = {name: weight_bytes(model) / MB for name, model in models.items()}
    print("weight MB:", ", ".join(f"{k} {v:.0f}" for k, v in memory.items()))
    return dict(table=table, weight_mb=memory)


# ---- 7b ----------------------------------------------------------------------------------------------------------

def random_int4_model(config: ModelConfig, group_size: int, seed: int, std: float = 0.02) -> Transformer:
    """A model with random int4 weights, built without ever holding a float copy of its linear layers or its
    embedding: the Transformer is made on the meta device, each linear layer replaced by a QuantizedLinear of
    random codes (scales set so the weights have about `std`), the embedding by a QuantizedEmbedding of random
    int8 codes, then the remaining tensors (norms) made real."""
    with torch.device("meta"):
        model = Transformer(config)
    gen = torch.Generator().manual_seed(seed)
    for _, parent, attr, child in linear_modules(model):
        N, K = child.weight.shape
        scales = torch.full((N, K // group_size), std / 4.6)  # codes uniform on 0..15 have std 4.6
        weight = Int4Weight(torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8), scales, scales / 2)
        setattr(parent, attr, QuantizedLinear(weight))
    V, D = config.vocab_size, config.dim
    codes = torch.randint(-127, 128, (V, D), generator=gen, dtype=torch.int8)  # uniform codes: std 73.3
    model.tok_embeddings = QuantizedEmbedding(Int8GroupWeight(codes, torch.full((V, D // 32), std / 73.3)))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                value = torch.ones(param.shape) if "norm" in type(module).__name__.lower() else \
                    std * torch.randn(param.shape, generator=gen)
                setattr(module, name, nn.Parameter(value, requires_grad=False))
    model.setup_rope()
    return model.eval()


def run_7b(args: argparse.Namespace) -> dict:
    """llama-7b shapes, int4 in groups of --big-group, an int8 embedding, float32 around the quantized layers and
    a float32 cache of 512 positions: weight bytes, peak resident memory (of the whole process: run this part
    alone to read it as the model's), build time and plain-decoding tokens/s (a 16-token prompt, median of
    repeats)."""
    config = ModelConfig.preset("llama-7b").replace(max_seq_len=512)
    start = time.perf_counter()
    model = random_int4_model(config, args.big_group, args.seed)
    build_s = time.perf_counter() - start
    prompt = torch.randint(config.vocab_size, (16,)).tolist()
    generate(model, prompt, Autoregressive(), 2)  # warm-up
    rates = [(lambda s: s.steps / s.decode_s)(generate(model, prompt, Autoregressive(), args.big_tokens)[1])
             for _ in range(args.repeats)]
    result = dict(weight_gb=weight_bytes(model) / 1e9, peak_rss_gb=peak_rss_bytes() / 1e9, build_s=build_s,
                  tokens_per_s=statistics.median(rates), n_params=config.n_params, group_size=args.big_group)
    print(f"llama-7b int4 g{args.big_group}: weights {result['weight_gb']:.2f} GB, "
          f"peak resident {result['peak_rss_gb']:.2f} GB "
          f"(process so far), built in {build_s:.0f} s, {result['tokens_per_s']:.2f} tokens/s "
          f"({args.big_tokens} tokens, median of {args.repeats})")
    return result


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


# ---- ppl ---------------------------------------------------------------------------------------------------------

def run_ppl(args: argparse.Namespace) -> dict:
    """Perplexity over the first --ppl-prompts HumanEval prompts joined by blank lines, in one causal pass."""
    llm, checkpoint = load_real(args)
    texts = load_prompt_texts(args.data_dir, ["humaneval"], args.ppl_prompts)["humaneval"]
    ids = torch.tensor([llm.encode("\n\n".join(texts), chat=False)])
    # The path of a float checkpoint: round-to-nearest from the float weights (copied before variants() prepacks
    # the float model's weights, which cannot be deep-copied after).
    config = llm.model.config
    rtn = {f"int4 rtn g{group}": quantize_embedding(quantize_linears(copy.deepcopy(llm.model), "int4", group))
           for group in (32, 64) if config.dim % group == 0 and config.intermediate_size % group == 0}
    models = {**variants(llm, checkpoint), **rtn}
    table = {}
    for name, model in models.items():
        value = perplexity(model, ids)
        table[name] = dict(ppl=value, vs_float32=value / table["float32"]["ppl"] - 1 if table else 0.0)
    print_table(f"perplexity over {ids.shape[1]} tokens ({args.ppl_prompts} HumanEval prompts)", table, ".4f")
    return dict(tokens=ids.shape[1], table=table)


def perplexity(model: Transformer, ids: torch.Tensor) -> float:
    cache = model.new_cache(ids.shape[1])
    logits = model(ids, torch.arange(ids.shape[1]), cache)[0, :-1].float()
    return math.exp(F.cross_entropy(logits, ids[0, 1:]).item())


PART_RUNNERS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "layers": run_layers, "decode": run_decode, "steps": run_steps, "7b": run_7b, "ppl": run_ppl}

if __name__ == "__main__":
    sys.exit(main())
