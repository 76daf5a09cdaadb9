"""What one rank of a test runs: `python -m tests.parallel.worker SCENARIO FOLDER [ARGS]` (see ranks.py).

Each scenario writes what the test compares to FOLDER/rank{R}.pt; errors go to stderr as one line, exit 2."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from minilade.checkpoints import open_checkpoint
from minilade.decoding import (
    Auto,
    Autoregressive,
    GenerationSettings,
    GenerationStats,
    Lookahead,
    Strategy,
    TokenRun,
    decode_tokens,
)
from minilade.model import Transformer
from minilade.parallel import TensorParallelError, end_run, from_rank0, init_tensor_parallel
from minilade.parallel.load import build_rank_model, checkpoint_parts
from minilade.parallel.plan import ShardPlan
from minilade.sampling import SamplingParams
from tests.parallel.reference import GEN_PROMPT, PENALIZED, STEP_COSTS, lookahead_step, prefill_and_step

TIMEOUT_S = float(os.environ.get("TEST_TIMEOUT_S", "20"))  # the process group's timeout


def shard(ckpt: str, dtype: torch.dtype):
    """This rank's model of the checkpoint folder `ckpt`, the whole vocabulary in its head."""
    group = init_tensor_parallel(torch.device("cpu"), TIMEOUT_S)
    checkpoint = open_checkpoint(ckpt)
    plan = ShardPlan(checkpoint.config, dist.get_rank(), dist.get_world_size(), checkpoint.config.vocab_size)
    return build_rank_model(plan, checkpoint_parts(checkpoint, plan), dtype=dtype, device="cpu", group=group)


def logits(folder: str, *checkpoints: str) -> dict:
    """Per checkpoint folder: logits of a prefill and of a lookahead step after it (float64)."""
    return {ckpt: dict(zip(("prefill", "step"), prefill_and_step(shard(ckpt, torch.float64), lookahead_step())))
            for ckpt in checkpoints}


def sharded_tokens(model: Transformer, strategy: Strategy, max_new_tokens: int,
                   sampling: SamplingParams = SamplingParams()) -> list[int]:
    """GEN_PROMPT's new tokens, decoded as llm.py decodes on a sharded model: rank 0's decisions for all."""
    settings = GenerationSettings(strategy, sampling, max_new_tokens)
    run = TokenRun(GenerationStats())
    return list(decode_tokens(model, GEN_PROMPT, run, settings, agree=functools.partial(from_rank0, model)))


def generate(folder: str, ckpt: str) -> dict:
    """Greedy tokens of every strategy, and sampled tokens with and without a seed."""
    model = shard(ckpt, torch.float64)
    strategies = {"autoregressive": Autoregressive(), "lookahead": Lookahead(window=4, ngram=3, guesses=3),
                  "auto": Auto(window=4, ngram=3, guesses=3),  # step costs measured
                  "auto-drafting": Auto(window=4, ngram=3, guesses=3, costs=STEP_COSTS)}
    out = {name: sharded_tokens(model, strategy, 30) for name, strategy in strategies.items()}
    for seed in (7, None):
        out[f"sampled-{seed}"] = sharded_tokens(model, Lookahead(window=4, ngram=3, guesses=3), 20,
                                                SamplingParams(temperature=1.0, seed=seed))
    return out


def llm(folder: str, ckpt: str, prompt: str) -> dict:
    """Greedy tokens through the library's front door: LLM.load(tensor_parallel=True), float32, exact."""
    from minilade import LLM

    model = LLM.load(ckpt, dtype="float32", device="cpu", progress=False, tensor_parallel=True)
    return {name: model.generate(prompt, max_new_tokens=8, strategy=strategy).token_ids
            for name, strategy in (("autoregressive", Autoregressive()), ("lookahead", Lookahead()))}


def llm_penalized(folder: str, ckpt: str, prompt: str) -> dict:
    """Penalized sampling without a seed (reference.PENALIZED) through LLM.load(tensor_parallel=True)."""
    from minilade import LLM

    model = LLM.load(ckpt, dtype="float32", device="cpu", progress=False, tensor_parallel=True)
    return {name: model.generate(prompt, max_new_tokens=12, strategy=strategy, **PENALIZED).token_ids
            for name, strategy in (("autoregressive", Autoregressive()), ("lookahead", Lookahead()))}


def llm_per_rank(folder: str, *checkpoints: str) -> dict:
    """LLM.load of checkpoints[rank] (ranks that disagree, or one that cannot open its file)."""
    from minilade import LLM
    from minilade.parallel import init_tensor_parallel

    init_tensor_parallel(torch.device("cpu"), TIMEOUT_S)
    LLM.load(checkpoints[dist.get_rank()], dtype="float32", device="cpu", progress=False, tensor_parallel=True)
    return {}


def peer_dies(folder: str, ckpt: str) -> dict:
    """Rank 1 exits right after loading; rank 0 then decodes."""
    model = shard(ckpt, torch.float64)
    if dist.get_rank() == 1:
        os._exit(3)
    sharded_tokens(model, Autoregressive(), 5)
    return {}


SCENARIOS = {"logits": logits, "generate": generate, "llm": llm, "llm_penalized": llm_penalized,
             "llm_per_rank": llm_per_rank, "peer_dies": peer_dies}


def main(scenario: str, folder: str, *args: str) -> int:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        result = SCENARIOS[scenario](folder, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        return end_run(0, finished=True)
    except (TensorParallelError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return end_run(2)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
