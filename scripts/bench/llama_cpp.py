"""llama.cpp as a peer for plain decoding, when it is on the machine: tokens/s on the same GGUF file and threads.

Two ways in, tried in order:
- a `llama-bench` binary on PATH: `llama-bench -m FILE -t THREADS -p 0 -n N -r REPEATS -o json` (its own timing:
  N tokens generated after an empty prompt; `avg_ts` is their mean rate);
- the `llama_cpp` Python package (llama-cpp-python): a greedy completion of N tokens after a warm-up, timed here.
Neither is a dependency of minilade; without both the result says it was skipped and why.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import time
from typing import Any

from minilade.checkpoints.resolve import resolve_checkpoint

PROMPT = "def fibonacci(n):"  # the llama-cpp-python path's prompt (llama-bench generates after an empty one)


def llama_cpp_peer(ckpt: str, threads: int, n_gen: int, repeats: int = 3) -> dict[str, Any]:
    """llama_cpp_decode on the file a minilade checkpoint argument names (a path, or a name such as the default
    checkpoint's, resolved as LLM.load resolves it); skipped with a note when that is no GGUF file."""
    path = resolve_checkpoint(ckpt, progress=False)
    if path.suffix != ".gguf":
        return dict(status="skipped", tokens_per_s=None, how=None,
                    note=f"llama.cpp reads GGUF files; the checkpoint is {path}")
    return llama_cpp_decode(str(path), threads, n_gen, repeats)


def llama_cpp_decode(gguf: str, threads: int, n_gen: int, repeats: int = 3) -> dict[str, Any]:
    """{"status": "ran" | "skipped" | "failed", "tokens_per_s", "how", "note"} for plain decoding by llama.cpp."""
    if shutil.which("llama-bench"):
        return _llama_bench(gguf, threads, n_gen, repeats)
    if importlib.util.find_spec("llama_cpp") is not None:
        return _llama_cpp_python(gguf, threads, n_gen, repeats)
    return dict(status="skipped", tokens_per_s=None, how=None,
                note="neither llama-bench (on PATH) nor llama-cpp-python is installed on this machine")


def _llama_bench(gguf: str, threads: int, n_gen: int, repeats: int) -> dict[str, Any]:
    command = ["llama-bench", "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(n_gen), "-r", str(repeats),
               "-o", "json"]
    how = " ".join(command)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
        records = json.loads(done.stdout)
        rate = next(float(r["avg_ts"]) for r in records if int(r.get("n_gen", 0)) == n_gen)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, StopIteration) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return dict(status="failed", tokens_per_s=None, how=how, note=f"llama-bench: {reason}")
    return dict(status="ran", tokens_per_s=rate, how=how, note=f"llama-bench avg_ts, {repeats} repetitions")


def _llama_cpp_python(gguf: str, threads: int, n_gen: int, repeats: int) -> dict[str, Any]:
    how = f"llama_cpp.Llama({gguf!r}, n_threads={threads}).create_completion(max_tokens={n_gen}, temperature=0)"
    try:
        llama = importlib.import_module("llama_cpp").Llama(model_path=gguf, n_threads=threads, n_ctx=512,
                                                            verbose=False)
        llama.create_completion(PROMPT, max_tokens=4, temperature=0.0)  # warm-up
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = llama.create_completion(PROMPT, max_tokens=n_gen, temperature=0.0)
            rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - start))
    except Exception as exc:  # a third-party library: whatever it raises, the peer row says so and the run goes on
        return dict(status="failed", tokens_per_s=None, how=how, note=f"llama-cpp-python: {exc}".splitlines()[0])
    rates.sort()
    return dict(status="ran", tokens_per_s=rates[len(rates) // 2], how=how,
                note=f"median of {repeats} completions (prompt evaluation included)")
