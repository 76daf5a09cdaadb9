"""Fuzz the checkpoint readers with mutated files: every load must end in a correct model or in one clean line.

    python -m scripts.fuzz_checkpoints --mutations 5000 [--seed 0] [--seconds 5]

Two tiny checkpoints are written from random weights -- a GGUF file and a safetensors folder -- and then mutated,
one mutation per load (scripts/fuzz_mutations.py). Each mutated checkpoint is opened, its model built and its
generation defaults read (minilade.checkpoints.open_checkpoint, load_model, read_generation_defaults). The
outcome must be a load, or a ValueError subclass from minilade.errors whose message is one line naming the file,
within --seconds; anything else (another exception type, a timeout, a multi-line message) is a failure.
tests/checkpoints/test_fuzz.py runs a few hundred mutations; this script the longer runs. Exit status 1 when any
mutation failed, with one line per failure.
"""

from __future__ import annotations

import random
import resource
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minilade import errors
from minilade.checkpoints import open_checkpoint
from minilade.checkpoints.generation_config import read_generation_defaults

from .bench.common import JobParser, at_least, positive_int, run_job
from .fuzz_mutations import MUTATIONS, make_bases

# The errors a bad file may raise: minilade's own (all ValueError subclasses, messages of one line).
CLEAN_ERRORS = (errors.CheckpointError, errors.UnsupportedModelError, errors.TokenizerError)


@dataclass
class Outcome:
    mutation: str
    result: str  # "loaded", "refused" or "FAILED"
    detail: str
    seconds: float


class _Timeout(BaseException):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def judge(description: str, path: Path, seconds: float) -> Outcome:
    """Open and build the checkpoint at `path` under a wall-clock alarm, and classify the outcome."""
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        checkpoint = open_checkpoint(path, progress=False)
        checkpoint.load_model(dtype=torch.float32, device="cpu")
        read_generation_defaults(checkpoint.path)
        result, detail = "loaded", f"{checkpoint.config.n_layers} layers"
    except CLEAN_ERRORS as exc:
        message = str(exc)
        clean = "\n" not in message and path.name in message
        result, detail = ("refused" if clean else "FAILED"), message if clean else f"unclear message: {message!r}"
    except _Timeout:
        result, detail = "FAILED", f"no answer within {seconds} s"
    except Exception as exc:  # noqa: BLE001 -- any other exception type is what the fuzzer looks for
        result, detail = "FAILED", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(description, result, detail, time.perf_counter() - start)


def run(mutations: int, seed: int, seconds: float, work: Path) -> list[Outcome]:
    """`mutations` seeded mutations of the two base checkpoints, each judged."""
    rng = random.Random(seed)
    bases = make_bases(work, seed)
    outcomes = []
    for _ in range(mutations):
        description, path = rng.choice(MUTATIONS)(bases, rng)
        outcomes.append(judge(description, path, seconds))
    return outcomes


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def job(argv: list[str]) -> int:
    parser = JobParser("scripts.fuzz_checkpoints", __doc__.splitlines()[0])
    parser.add_argument("--mutations", type=positive_int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=at_least(0.1, float), default=5.0, help="wall-clock limit of one load")
    args = parser.parse_args(argv)
    before = peak_rss_mib()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minilade-fuzz-") as work:
        outcomes = run(args.mutations, args.seed, args.seconds, Path(work))
    counts = {kind: sum(o.result == kind for o in outcomes) for kind in ("loaded", "refused", "FAILED")}
    slowest = max(outcomes, key=lambda o: o.seconds)
    print(f"command: python -m scripts.fuzz_checkpoints {' '.join(argv)}")
    print(f"{len(outcomes)} mutations in {time.perf_counter() - start:.1f} s: {counts['loaded']} loaded, "
          f"{counts['refused']} refused cleanly, {counts['FAILED']} failed; slowest load {slowest.seconds:.2f} s "
          f"({slowest.mutation}); peak RSS {before:.0f} -> {peak_rss_mib():.0f} MiB")
    for outcome in outcomes:
        if outcome.result == "FAILED":
            print(f"FAILED {outcome.mutation}: {outcome.detail}")
    return 1 if counts["FAILED"] else 0


def main(argv: list[str] | None = None) -> int:
    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())
