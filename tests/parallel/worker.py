"""What one rank of a test runs: `python -m tests.parallel.worker SCENARIO FOLDER [ARGS]` (see ranks.py).

Each scenario writes what the test compares to FOLDER/rank{R}.pt; errors go to stderr as one line, exit 2."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from minilade.checkpoints import open_checkpoint
from minilade.decoding import Auto, Autoregressive, Lookahead
from minilade.parallel import TensorParallelError, end_failed_run, init_tensor_parallel, shutdown
from minilade.parallel.load import build_rank_model, checkpoint_parts
from minilade.parallel.plan import ShardPlan
from minilade.sampling import SamplingParams
from tests.helpers import run_tokens
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


def generate(folder: str, ckpt: str) -> dict:
    """Greedy tokens of every strategy, and sampled tokens with and without a seed."""
    model = shard(ckpt, torch.float64)
    strategies = {"autoregressive": Autoregressive(), "lookahead": Lookahead(window=4, ngram=3, guesses=3),
                  "auto": Auto(window=4, ngram=3, guesses=3)}  # step costs measured
    out = {name: run_tokens(model, GEN_PROMPT, s, max_new_tokens=30)[0] for name, s in strategies.items()}
    drafting = Auto(window=4, ngram=3, guesses=3, costs=STEP_COSTS)
    out["auto-drafting"] = run_tokens(model, GEN_PROMPT, drafting, max_new_tokens=30)[0]
    for seed in (7, None):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        out[f"sampled-{seed}"] = run_tokens(model, GEN_PROMPT, Lookahead(window=4, ngram=3, guesses=3),
                                            max_new_tokens=20, sampling=sampling)[0]
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
    run_tokens(model, GEN_PROMPT, Autoregressive(), max_new_tokens=5)
    return {}


SCENARIOS = {"logits": logits, "generate": generate, "llm": llm, "llm_penalized": llm_penalized,
             "llm_per_rank": llm_per_rank, "peer_dies": peer_dies}


def main(scenario: str, folder: str, *args: str) -> int:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        result = SCENARIOS[scenario](folder, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        shutdown(finished=True)
    except (TensorParallelError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return end_failed_run(2)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
