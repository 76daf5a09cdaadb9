"""What every benchmark job shares: the prompt sets, lookahead settings on the command line, the record of the
machine a run happened on, output files that are never half-written, and the one-line usage error."""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch
from tqdm import tqdm

from minilade import LLM
from minilade.checkpoints import DEFAULT_CHECKPOINT
from minilade.config import PRESETS, ModelConfig
from minilade.errors import (
    CheckpointError,
    TokenizerError,
    UnsupportedModelError,
    one_line,
)
from minilade.masks import LookaheadLayout
from minilade.memo import cpu_fields, simd_flags

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = (REPO_ROOT / ".." / "shared" / "data").resolve()  # never copied into the project
DEFAULT_OUT_DIR = REPO_ROOT / "bench_out"
EXIT_USAGE = 2
CPU_DTYPES = ("float32", "bfloat16")  # the jobs run on the CPU, where minilade has no float16

Setting = tuple[int, int, int]  # lookahead (W, N, G)


@dataclass(frozen=True)
class PromptSet:
    """One dataset: its jsonl file, the prompt text of a record, and whether it goes through the chat template.
    follow_up: for a second-turn set, the question asked after the model's own answer to `prompt` (TwoTurns)."""

    file: str
    prompt: Callable[[dict], str]
    chat: bool
    follow_up: Callable[[dict], str] | None = None


@dataclass(frozen=True)
class TwoTurns:
    """A second-turn prompt: the chat holds `first`, the model's own answer to it (plain greedy decoding, made when
    the prompt is encoded: encode_prompts), then `second`, which is what gets answered."""

    first: str
    second: str


FIRST_ANSWER_TOKENS = 128
DATASETS: dict[str, PromptSet] = {
    "mt_bench": PromptSet("mt_bench.jsonl", lambda record: record["turns"][0], chat=True),
    "humaneval": PromptSet("humaneval.jsonl", lambda record: record["prompt"], chat=False),
    "gsm8k": PromptSet("gsm8k_test.jsonl", lambda record: record["question"], chat=True),
    # MT-Bench's second turn, the first turn and the model's answer to it in the context (multi-turn chat)
    "mt_bench_turn2": PromptSet("mt_bench.jsonl", lambda record: record["turns"][0], chat=True,
                                follow_up=lambda record: record["turns"][1]),
}
DEFAULT_DATASETS = ["mt_bench", "humaneval", "gsm8k"]  # the paper's three; the second turn is asked for by name


# ---- command line ----------------------------------------------------------------------------------------------

class UsageError(Exception):
    """Bad input to a job (an option, a missing data file or dependency): one line on stderr, exit status 2."""


class JobParser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors (one line), not a usage block followed by sys.exit."""

    def __init__(self, module: str, description: str | None) -> None:
        super().__init__(prog=f"python -m {module}", description=description,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def at_least(minimum: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse type: a number of the given kind, no smaller than minimum."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {text}")
        return value

    return parse


positive_int = at_least(1)
sampling_temperature = at_least(0.0, float)


def lookahead_setting(text: str) -> Setting:
    """'W,N,G' -> (W, N, G), validated by the library's own layout (which raises ValueError)."""
    try:
        w, n, g = (int(x) for x in text.split(","))
        LookaheadLayout(window=w, ngram=n, guesses=g)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad lookahead setting {text!r}: expected W,N,G such as 7,5,7 ({e})") \
            from None
    return w, n, g


def setting_text(setting: Setting) -> str:
    return "{},{},{}".format(*setting)


def add_prompt_options(p: argparse.ArgumentParser, n_prompts: int) -> None:
    """The options of every job that runs the model on the prompt sets."""
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT, help="a .gguf file or a checkpoint folder (as the CLI)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="folder of the jsonl prompt sets")
    p.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=DEFAULT_DATASETS,
                   help=f"prompt sets (default: {' '.join(DEFAULT_DATASETS)}; mt_bench_turn2 is MT-Bench's second "
                        f"turn after the model's own greedy answer to the first)")
    p.add_argument("--n-prompts", type=positive_int, default=n_prompts, help="first N prompts of each dataset")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_settings_option(p: argparse.ArgumentParser, default: Sequence[Setting]) -> None:
    p.add_argument("--settings", nargs="+", type=lookahead_setting, default=list(default), metavar="W,N,G",
                   help=f"lookahead settings (default: {' '.join(setting_text(s) for s in default)})")


def add_timed_options(p: argparse.ArgumentParser, quick_defaults: dict) -> None:
    """The options of the side-by-side timed jobs (decode, ar)."""
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs of each (prompt, contender); median kept")
    p.add_argument("--seed", type=int, default=0, help="seeds the run order (and decode's sampling seeds)")
    p.add_argument("--no-transformers", action="store_true", help="leave out the transformers rows")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--quick", action="store_true",
                   help="smoke-test defaults: " + ", ".join(f"{k}={v}" for k, v in quick_defaults.items()))


def add_random_model_options(p: argparse.ArgumentParser, out_dir: Path) -> None:
    """The options of the jobs that time a model of a preset's shape with random weights (invariance_cost,
    row_cost)."""
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS), help="the model's shape")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights and inputs")
    p.add_argument("--out-dir", type=Path, default=out_dir)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def preset_fitting(name: str, positions: int) -> ModelConfig:
    """The preset's configuration, or a UsageError if a run needs more than its `positions`."""
    config = ModelConfig.preset(name)
    if positions > config.max_seq_len:
        raise UsageError(f"context and rows need {positions} positions; the {name} shape has {config.max_seq_len}")
    return config


def parse_with_quick(parser: argparse.ArgumentParser, argv: Sequence[str], quick_defaults: dict) -> argparse.Namespace:
    """--quick changes the defaults only, so explicit flags still win."""
    if "--quick" in argv:
        parser.set_defaults(**quick_defaults)
    return parser.parse_args(argv)


def command_line(module: str, argv: Sequence[str]) -> str:
    """How to run this job again, as recorded in its output."""
    return shlex.join(["python", "-m", module, *argv])


def run_job(job: Callable[[list[str]], int], argv: Sequence[str] | None) -> int:
    """Runs a job's main body; bad input ends it with one line on stderr and exit status 2."""
    try:
        return job(list(sys.argv[1:] if argv is None else argv))
    except (UsageError, CheckpointError, TokenizerError, UnsupportedModelError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


def run_timed_job(module: str, parse_args: Callable[[list[str]], argparse.Namespace],
                  run: Callable[[argparse.Namespace, str, dict], Any], argv: Sequence[str] | None) -> int:
    """A timed job (decode, ar): options, then the command and the machine printed, then run(args, command,
    environment record), which writes its results under args.out_dir."""
    def job(argv: list[str]) -> int:
        args = parse_args(argv)
        command = command_line(module, argv)
        run(args, command, begin_timed_run(command, args.threads))
        print(f"\nwrote {args.out_dir}", file=sys.stderr)
        return 0

    return run_job(job, argv)


# ---- prompts ---------------------------------------------------------------------------------------------------

def load_prompt_texts(data_dir: Path, names: Sequence[str], n: int) -> dict[str, list[str | TwoTurns]]:
    """The first n prompt texts of each dataset (TwoTurns for a second-turn set). Every file is checked before
    any is read."""
    paths = {name: data_dir / DATASETS[name].file for name in names}
    for path in paths.values():
        if not path.is_file():
            raise UsageError(f"data file not found: {path} (pass --data-dir)")
    texts = {}
    for name, path in paths.items():
        with path.open(encoding="utf-8") as f:
            records = [json.loads(line) for line in itertools.islice((line for line in f if line.strip()), n)]
        s = DATASETS[name]
        texts[name] = [s.prompt(r) if s.follow_up is None else TwoTurns(s.prompt(r), s.follow_up(r)) for r in records]
    return texts


def encode_prompts(llm: LLM, texts: dict[str, list[str | TwoTurns]], show_progress: bool = True,
                   first_answer_tokens: int = FIRST_ANSWER_TOKENS) -> dict[str, list[list[int]]]:
    """Token ids of each prompt, through the chat template where its dataset asks; each must fit the context.
    A TwoTurns prompt first has the model answer its first turn, in at most first_answer_tokens (a progress bar
    counts those answers)."""
    limit = llm.model.config.max_seq_len
    n_answers = sum(isinstance(t, TwoTurns) for items in texts.values() for t in items)
    with progress(n_answers, "first turns", show_progress and n_answers > 0) as bar:
        def encode(item: str | TwoTurns, chat: bool) -> list[int]:
            if not isinstance(item, TwoTurns):
                return llm.encode(item, chat=chat)
            answer = llm.generate(item.first, chat=True, max_new_tokens=first_answer_tokens, temperature=0.0,
                                  strategy="autoregressive").text
            bar.update()
            return llm.encode([{"role": "user", "content": item.first}, {"role": "assistant", "content": answer},
                               {"role": "user", "content": item.second}])

        prompts = {name: [encode(t, DATASETS[name].chat) for t in items] for name, items in texts.items()}
    for name, items in prompts.items():
        for i, ids in enumerate(items):
            if len(ids) >= limit:
                raise UsageError(f"{name} prompt {i} has {len(ids)} tokens; the model's context is {limit}")
    return prompts


def progress(total: int, desc: str, enabled: bool = True) -> tqdm:
    """A progress bar on stderr, so stdout keeps only the tables."""
    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, file=sys.stderr)


# ---- timing ----------------------------------------------------------------------------------------------------

def median_seconds(fn: Callable[[], Any], reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of reps calls of fn, after one more call that warms up and is not counted."""
    times = []
    for _ in range(reps + 1):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times[1:])


# ---- the machine -----------------------------------------------------------------------------------------------

def environment() -> dict:
    """Where and on what a job ran (taken at the start; a timed job adds its load average at the end)."""
    cpuinfo = cpu_fields()
    return dict(python=platform.python_version(), torch=torch.__version__, transformers=package_version("transformers"),
                threads=torch.get_num_threads(), cpu=cpuinfo.get("model name", platform.processor()),
                cpu_flags=simd_flags(cpuinfo.get("flags", "")), cores=os.cpu_count(),
                load_average_1m_start=load_average(), platform=platform.platform(), git_commit=git("rev-parse", "HEAD"),
                git_dirty=bool(git("status", "--porcelain")), time=time.strftime("%Y-%m-%d %H:%M:%S %z"))


def begin_timed_run(command: str, threads: int | None) -> dict:
    """Sets torch's CPU threads, prints the command and the machine, and returns the environment record."""
    if threads:
        torch.set_num_threads(threads)
    env = environment()
    print(f"command: {command}", flush=True)
    print(describe_machine(env), flush=True)
    return env


def describe_machine(env: dict) -> str:
    """The lines printed before a timed job's tables."""
    return (f"machine: {env['cores']} cores, torch threads {env['threads']}, load average "
            f"{fmt(env['load_average_1m_start'], '.2f')} at start (other work on the machine skews absolute figures, "
            f"less so the ratios)\ncpu: {env['cpu']}; flags: {' '.join(env['cpu_flags']) or 'none of avx*, amx*'}")


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git(*cmd: str) -> str:
    try:
        done = subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def options_record(args: argparse.Namespace) -> dict:
    """The parsed options as JSON values."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


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


def write_json(path: Path, document: dict, indent: int | None = None) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(document, indent=indent, default=str) + "\n"))


def write_png(path: Path, figure: Any) -> None:
    """A matplotlib Figure as a PNG file."""
    figure.tight_layout()
    write_atomic(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))


def fmt(value: Any, spec: str = "") -> str:
    """A table cell: empty for a missing value."""
    return "" if value is None else format(value, spec)
