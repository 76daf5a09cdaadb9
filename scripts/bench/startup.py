"""Start-up: seconds from launching a process to its first generated text, for the command line and the library.

    python -m scripts.bench.startup                  # the demo model, 5 timed runs of each after one warm-up
    python -m scripts.bench.startup --runs 3 --ckpt path/model.gguf

Each run is a fresh Python process (imports, weights, the exactness verdicts and step costs as a user's run
finds them): the CLI as `python -m minilade.generate --chat PROMPT`, the library as `LLM.load()` then
`llm.stream(PROMPT, chat=True)`. The warm-up run keeps this machine's measurements (where the CLI keeps them) and
warms the page cache, so the timed runs show a start with the measurements kept. Per run: seconds to the first
byte on stdout, seconds to exit, and the process's peak resident memory (the kernel's ru_maxrss).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
LIBRARY = """
import sys
from minilade import LLM
llm = LLM.load(sys.argv[1] or None, compile={"on": True, "off": False}.get(sys.argv[4], sys.argv[4]))
for piece in llm.stream(sys.argv[2], chat=True, max_new_tokens=int(sys.argv[3])):
    sys.stdout.write(piece)
    sys.stdout.flush()
"""


def commands(ckpt: str | None, prompt: str, max_new_tokens: int, compile: str = "auto") -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "minilade.generate", "--chat", prompt, "--max-new-tokens", str(max_new_tokens),
           "--compile", compile]
    library = [sys.executable, "-c", LIBRARY, ckpt or "", prompt, str(max_new_tokens), compile]
    return {"CLI": cli + (["--ckpt", ckpt] if ckpt else []), "library": library}


def timed_run(command: list[str]) -> tuple[float, float, float]:
    """(seconds to the first stdout byte, seconds to exit, peak resident MiB) of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = process.stdout.read(1)
    first_byte = time.perf_counter() - start
    process.stdout.read()
    err = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    done = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0 or not first:
        raise SystemExit(f"{command[:4]} failed (exit {process.returncode}): {err.decode(errors='replace')[-500:]}")
    return first_byte, done, usage.ru_maxrss / 1024  # Linux: KiB


def cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "flags: unknown"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=None, help="default: the demo model")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt", default="Hi")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--entries", nargs="+", choices=["CLI", "library"], default=["CLI", "library"])
    p.add_argument("--compile", choices=["off", "on", "auto"], default="auto",
                   help="the CLI's --compile (LLM.load's compile), the default's by default; with on, the warm-up run "
                        "compiles and keeps the graphs")
    args = p.parse_args(argv)
    print(cpu_flags())
    print("| entry | first token (s), median | exit (s), median | peak memory (MiB), median | runs (first token, s) |")
    print("| --- | --- | --- | --- | --- |")
    for name, command in commands(args.ckpt, args.prompt, args.max_new_tokens, args.compile).items():
        if name not in args.entries:
            continue
        timed_run(command)  # warm-up: keeps the machine's measurements, warms the page cache
        runs = [timed_run(command) for _ in range(args.runs)]
        first, done, peak = (statistics.median(column) for column in zip(*runs))
        each = ", ".join(f"{r[0]:.2f}" for r in runs)
        print(f"| {name} | {first:.2f} | {done:.2f} | {peak:.0f} | {each} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
