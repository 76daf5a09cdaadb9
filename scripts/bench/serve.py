"""The server under concurrent load: aggregate tokens/s and latencies at 1, 2, 4, 8 clients, side by side.

Each mode is a `python -m minilade.serve` process on a free loopback port, all started, loaded and warmed up
with one short request first (an idle server takes no CPU), then run level by level, the modes in turn at each
level (their order rotating), so that slow and fast spells of a shared machine fall on every mode alike:
- one-at-a-time: --max-concurrent 1 (each request runs alone, as the library runs it; the others queue);
- batched-plain: every request's generation shares each forward pass, plain decoding (strategy autoregressive);
- batched-auto: the same with auto, greedy requests sizing their drafts for the whole pass (the default);
- batched-auto-alone: auto with --plan alone, each request sizing its drafts as if it ran alone.
At one client, `library` is the same prompts through LLM.generate with auto in this process, loaded as the servers
load the model (--compile as theirs: compiled steps where they are chosen by default, as the CLI's): the answers
every mode must equal.
Where `llama-server` is on PATH (llama.cpp's, e.g. built from the source vendored in llama-cpp-python), it serves
the same GGUF file with the same threads and one slot per client beside them (mode llama-server).
Each client streams its prompts one after another (chat prompts from MT-Bench or GSM8K, code from HumanEval,
greedy, --max-tokens new tokens); every level of concurrency takes the next prompts of the set. Reported per mode
and concurrency: aggregate completion tokens/s (all clients' tokens over the level's wall time), time to first
token and inter-chunk latency (p50/p99; a chunk carries one token or, after an accepted draft, several), rows per
forward pass and requests per pass (from /metrics), drafts fed and accepted by source, and the server's peak
resident memory. Every answer is compared with one-at-a-time's answer to the same prompt (identical counts).

    python -m scripts.bench.serve --data ../shared/data --set mt_bench --clients 1 2 4 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx
import torch

from minilade.checkpoints.resolve import resolve_checkpoint

from .common import DEFAULT_DATA_DIR, DEFAULT_OUT_DIR, command_line, environment, run_job, write_json, write_png
from .plots import import_figure

SETS = {"mt_bench": ("mt_bench.jsonl", lambda r: r["turns"][0], True),
        "gsm8k": ("gsm8k_test.jsonl", lambda r: r["question"], True),
        "humaneval": ("humaneval.jsonl", lambda r: r["prompt"], False)}
LLAMA_SERVER = "llama-server"
MODES = {"one-at-a-time": ("auto", 1, ()), "batched-plain": ("autoregressive", None, ()),
         "batched-auto": ("auto", None, ()), "batched-auto-alone": ("auto", None, ("--plan", "alone"))}
START_S = 600


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="folder of the prompt sets (shared/data)")
    p.add_argument("--set", choices=list(SETS), default="mt_bench")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--ckpt", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="auto", help="as the server's --quantize")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="as the server's --compile")
    p.add_argument("--no-library", action="store_true", help="skip the library's auto at one client")
    p.add_argument("--chat-turns", type=int, default=5,
                   help="then one conversation of this many turns (MT-Bench questions, one per turn) with and without "
                        "prompt-prefix reuse, timing each turn's first token (0: skip)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return p.parse_args(argv)


def set_prompts(data: Path, name: str) -> tuple[list[str], bool]:
    """Every prompt text of the set, and whether it goes through the chat template."""
    file, text, chat = SETS[name]
    path = data / file
    if not path.is_file():
        raise SystemExit(f"error: {path} not found (give --data, the folder holding {file})")
    return [text(json.loads(line)) for line in path.read_text().splitlines() if line.strip()], chat


def load_prompts(args: argparse.Namespace) -> tuple[list[str], bool]:
    texts, chat = set_prompts(args.data, args.set)
    needed = sum(args.clients) * args.prompts_per_client
    if len(texts) < needed:
        raise SystemExit(f"error: {args.data / SETS[args.set][0]} has {len(texts)} prompts; the run needs {needed}")
    return texts[:needed], chat


class Server:
    """A server process on a free loopback port, ready once /health says 200."""

    def __init__(self, command: Callable[[int], list[str]], minilade: bool = True) -> None:
        """command: the process's command line for a port."""
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        quiet = {} if minilade else dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # it logs every step
        self.process = subprocess.Popen(command(self.port), **quiet)
        self.url = f"http://127.0.0.1:{self.port}"
        self.minilade = minilade

    @classmethod
    def of_minilade(cls, args: argparse.Namespace, strategy: str, max_concurrent: int, *extra: str) -> Server:
        return cls(lambda port: [sys.executable, "-m", "minilade.serve", "--port", str(port), "--strategy", strategy,
                                 "--max-concurrent", str(max_concurrent), "--queue", "64", "--dtype", args.dtype,
                                 "--quantize", args.quantize, "--compile", args.compile, *extra]
                    + (["--ckpt", args.ckpt] if args.ckpt else []))

    @classmethod
    def of_llama_cpp(cls, gguf: Path, slots: int, threads: int) -> Server:
        """llama-server on the same file and threads, one slot per client, each slot with a 2048-token context."""
        return cls(lambda port: ["llama-server", "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c",
                                 str(2048 * slots), "--host", "127.0.0.1", "--port", str(port)], minilade=False)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit("error: the server did not start")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name, its labelled samples summed; drafts also by source ("name:source").
        Empty for llama-server."""
        values: Counter = Counter()
        if not self.minilade:
            return {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0].split()[0], float(line.split()[-1])
                values[name] += value
                source = re.search(r'source="([^"]*)"', line)
                if name.startswith("minilade_drafts") and source:
                    values[f"{name}:{source.group(1)}"] += value
        return dict(values)

    def peak_memory_mib(self) -> float | None:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return kib / 1024 if kib else None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def llama_server(args: argparse.Namespace) -> Server | None:
    """llama-server beside the modes, where it is on PATH and the checkpoint is a GGUF file; else None, said why."""
    if shutil.which("llama-server") is None:
        print("llama-server: not on PATH, not run")
        return None
    gguf = resolve_checkpoint(args.ckpt, progress=False)
    if gguf.suffix != ".gguf":
        print(f"llama-server: reads GGUF files, and the checkpoint is {gguf}; not run")
        return None
    return Server.of_llama_cpp(gguf, max(args.clients), torch.get_num_threads())


def streamed_events(url: str, path: str, body: dict):
    """POST a streaming request; each `data:` event as it arrives, parsed. Through http.client: a load generator
    shares the server's cores on loopback, and httpx's stream cost 0.32-0.40 ms of CPU a token against 0.08 here
    (8 clients, the server then 8-20% faster)."""
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=600)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        for line in connection.getresponse():
            if line.startswith(b"data: {"):
                yield json.loads(line[6:])
    finally:
        connection.close()


def one_request(url: str, prompt: str, chat: bool, max_tokens: int) -> dict:
    """Stream one greedy request; its text, tokens, time to first token and gaps between chunks (seconds)."""
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start, arrivals, text, tokens, kinds = time.perf_counter(), [], [], 0, {}
    for event in streamed_events(url, path, body):
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            piece = choice["delta"].get("content") if chat else choice.get("text")
            if piece:
                arrivals.append(time.perf_counter())
                text.append(piece)
        kinds = event.get("minilade", {}).get("step_kinds", kinds)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # llama-server may leave usage out of a stream; each of its chunks is one token.
    return {"text": "".join(text), "tokens": tokens or len(text), "ttft": arrivals[0] - start if arrivals else None,
            "gaps": gaps, "step_kinds": kinds}


def run_level(server: Server, prompts: list[str], chat: bool, clients: int, max_tokens: int) -> tuple[list, float]:
    """`clients` threads, each streaming the next prompt not yet sent as soon as its answer ends (a closed loop: the
    level ends one answer after the prompts run out, whichever client's answers ran long); the answers in prompt
    order, wall seconds."""
    answers: list[dict | None] = [None] * len(prompts)
    unsent = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                k = next(unsent, None)
            if k is None:
                return
            answers[k] = one_request(server.url, prompts[k], chat, max_tokens)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(answers: list[dict], seconds: float, before: dict, after: dict) -> dict:
    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)
    passes, rows, served = (delta(f"minilade_{n}_total") for n in ("forward_passes", "rows_fed", "pass_requests"))
    gaps = [g for a in answers for g in a["gaps"]]
    kinds = Counter()
    for a in answers:
        kinds.update(a["step_kinds"])
    drafts = {f"{kind} {name.split(':')[1]}": delta(name) for name in after
              for kind in ("fed", "accepted") if name.startswith(f"minilade_drafts_{kind}_total:")}
    return {"tokens": sum(a["tokens"] for a in answers), "seconds": seconds,
            "tokens_per_s": sum(a["tokens"] for a in answers) / seconds,
            "ttft_p50": percentile([a["ttft"] for a in answers if a["ttft"] is not None], 0.5),
            "ttft_p99": percentile([a["ttft"] for a in answers if a["ttft"] is not None], 0.99),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99),
            "rows_per_pass": rows / passes if passes else None,
            "requests_per_pass": served / passes if passes else None, "step_kinds": dict(kinds.most_common(6)),
            "drafts": {k: v for k, v in sorted(drafts.items()) if v}}


def library_run(args: argparse.Namespace, chat: bool) -> Callable[[list[str]], tuple[list[dict], float]]:
    """Runs prompts one after another through LLM.generate with auto in this process, as the CLI runs them (the
    model loaded as the servers load it)."""
    from minilade import LLM
    llm = LLM.load(args.ckpt, dtype=args.dtype, quantize=None if args.quantize == "none" else args.quantize,
                   progress=False, compile={"on": True, "off": False}.get(args.compile, "auto"))

    def run(prompts: list[str]) -> tuple[list[dict], float]:
        llm.generate(prompts[0], chat=chat, max_new_tokens=8, strategy="auto", temperature=0)  # warm-up
        answers, start = [], time.perf_counter()
        for prompt in prompts:
            out = llm.generate(prompt, chat=chat, max_new_tokens=args.max_tokens, strategy="auto", temperature=0)
            answers.append({"text": out.text, "tokens": len(out.token_ids), "ttft": out.stats.prefill_s,
                            "gaps": [], "step_kinds": {}})
        return answers, time.perf_counter() - start
    return run


def main_job(argv: list[str]) -> int:
    args = parse_args(argv)
    prompts, chat = load_prompts(args)
    env = environment()
    print(f"command: {command_line('scripts.bench.serve', argv)}")
    print(f"cpu: {env['cpu']}; flags: {' '.join(env['cpu_flags'])}; torch threads {env['threads']}")
    servers: dict[str, Server] = {}
    results: dict[str, dict] = {}
    reference: dict[int, str] = {}  # prompt index -> the first mode's answer
    try:
        for mode in args.modes:  # one at a time: a server measures its step costs while it loads
            strategy, limit, extra = MODES[mode]
            servers[mode] = Server.of_minilade(args, strategy, limit or max(args.clients), *extra)
            servers[mode].wait_ready()
            one_request(servers[mode].url, prompts[-1], chat, 16)  # warm-up (first passes, allocations)
        peer = llama_server(args)
        if peer is not None:
            servers[LLAMA_SERVER] = peer
            peer.wait_ready()
            one_request(peer.url, prompts[-1], chat, 16)
        libraries = {} if args.no_library else {"library": library_run(args, chat)}
        offset = 0
        for level, clients in enumerate(args.clients):
            share = prompts[offset:offset + clients * args.prompts_per_client]
            modes = (args.modes + ([LLAMA_SERVER] if LLAMA_SERVER in servers else [])
                     + (list(libraries) if level == 0 else []))
            texts: dict[str, dict[int, str]] = {}
            for mode in modes[level % len(modes):] + modes[:level % len(modes)]:  # the order rotates by level
                if mode in libraries:
                    answers, seconds = libraries[mode](share)
                    row = summarise(answers, seconds, {}, {})
                else:
                    before = servers[mode].metrics()
                    answers, seconds = run_level(servers[mode], share, chat, clients, args.max_tokens)
                    row = summarise(answers, seconds, before, servers[mode].metrics())
                results.setdefault(mode, {})[clients] = row
                texts[mode] = {offset + k: a["text"] for k, a in enumerate(answers)}
            reference.update(texts[args.modes[0]])
            for mode in modes:
                row = results[mode][clients]
                row["identical"] = sum(reference[k] == t for k, t in texts[mode].items())
                row["answers"] = len(texts[mode])
                print(line_of(mode, clients, row), flush=True)
            offset += len(share)
        for mode, server in servers.items():
            results[mode]["peak_memory_mib"] = server.peak_memory_mib()
    finally:
        for server in servers.values():
            server.stop()
    document = {"command": command_line("scripts.bench.serve", argv), "environment": env, "results": results,
                "chat_turns": chat_turns(args) if args.chat_turns else None}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "serve.json", document, indent=1)
    write_png(args.out_dir / "serve.png", plot(results, args.clients))
    print(f"wrote {args.out_dir / 'serve.json'} and serve.png")
    return 0


def conversation(server: Server, questions: list[str], max_tokens: int) -> list[dict]:
    """One chat, a question per turn, each turn resending the conversation so far: per turn its time to first token,
    prompt and cached tokens, and its answer."""
    messages, turns = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        start, first, text, usage = time.perf_counter(), None, [], {}
        for event in streamed_events(server.url, "/v1/chat/completions", body):
            usage = event.get("usage") or usage
            piece = event["choices"][0]["delta"].get("content") if event.get("choices") else None
            if piece:
                first = first or time.perf_counter() - start
                text.append(piece)
        turns.append({"ttft": first, "prompt_tokens": usage.get("prompt_tokens"), "answer": "".join(text),
                      "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens")})
        messages.append({"role": "assistant", "content": "".join(text)})
    return turns


def chat_turns(args: argparse.Namespace) -> dict:
    """The same conversation on a server that reuses prompt prefixes and on one that does not."""
    file, text, _ = SETS["mt_bench"]
    records = [json.loads(line) for line in (args.data / file).read_text().splitlines() if line.strip()]
    questions = [text(r) for r in records[-args.chat_turns:]]
    runs = {}
    for name, extra in (("reuse", ()), ("no reuse", ("--prompt-cache-mb", "0"))):
        server = Server.of_minilade(args, "auto", 1, *extra)
        server.wait_ready()
        try:
            runs[name] = conversation(server, questions, args.max_tokens)
        finally:
            server.stop()
    for i, (a, b) in enumerate(zip(runs["reuse"], runs["no reuse"])):
        print(f"chat turn {i + 1}: prompt {a['prompt_tokens']} tokens, cached {a['cached_tokens']}; TTFT with reuse "
              f"{1e3 * a['ttft']:.0f} ms, without {1e3 * b['ttft']:.0f} ms (x{a['ttft'] / b['ttft']:.2f}); same "
              f"answer: {a['answer'] == b['answer']}", flush=True)
    return runs


def line_of(mode: str, clients: int, r: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{1e3 * v:.0f}"
    drafts = ", ".join(f"{k} {v:g}" for k, v in r["drafts"].items())
    return (f"{mode:18s} clients {clients:2d}: {r['tokens_per_s']:7.1f} tok/s, TTFT p50/p99 {ms(r['ttft_p50'])}/"
            f"{ms(r['ttft_p99'])} ms, ITL p50/p99 {ms(r['itl_p50'])}/{ms(r['itl_p99'])} ms, rows/pass "
            f"{r['rows_per_pass'] or 0:.1f}, requests/pass {r['requests_per_pass'] or 0:.2f}, identical "
            f"{r['identical']}/{r['answers']}" + (f"; drafts {drafts}" if drafts else ""))


def plot(results: dict, clients: list[int]):
    figure = import_figure()(figsize=(11, 3.6))
    throughput, latency = figure.subplots(1, 2)
    for mode, rows in results.items():
        levels = [c for c in clients if c in rows]
        throughput.plot(levels, [rows[c]["tokens_per_s"] for c in levels], marker="o", label=mode)
        timed = [c for c in levels if rows[c]["itl_p99"] is not None]  # the library's answers are not streamed
        latency.plot(timed, [1e3 * rows[c]["itl_p99"] for c in timed], marker="o", label=mode)
    throughput.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", xscale="log", xticks=clients)
    latency.set(xlabel="concurrent clients", ylabel="p99 inter-chunk latency (ms)", xscale="log", xticks=clients)
    for ax in (throughput, latency):
        ax.minorticks_off()
        ax.set_xticklabels([str(c) for c in clients])
        ax.grid(alpha=0.3)
    latency.legend(*throughput.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    return figure


def main(argv: list[str] | None = None) -> int:
    return run_job(main_job, argv)


if __name__ == "__main__":
    sys.exit(main())
