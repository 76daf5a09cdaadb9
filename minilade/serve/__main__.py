"""python -m minilade.serve: an OpenAI-compatible HTTP server (docs/serve.md).

    python -m minilade.serve --ckpt smollm2-135m-instruct --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

SIGTERM or Ctrl-C: stop accepting, let running answers finish for up to --shutdown-timeout seconds, cancel the rest,
exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import signal
import sys
from pathlib import Path

import uvicorn

from ..checkpoints import DEFAULT_CHECKPOINT
from ..checkpoints.resolve import kept_tables_dir
from ..decoding import STRATEGIES
from ..decoding.auto import COST_SIZES
from ..decoding.step_costs import step_costs_for
from ..llm import LLM
from .app import Limits, Planning, Service, create_app
from .prefill import PREFILL_ALONE, PREFILL_CHUNK, PREFILL_PER_REQUEST
from .protocol import Served


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minilade.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=None, help=f"a .gguf file, a checkpoint folder, a Hugging Face repo id or "
                                                f"{DEFAULT_CHECKPOINT} (the default)")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: the checkpoint's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--max-concurrent", type=int, default=8, help="generations that share each forward pass (8)")
    p.add_argument("--queue", type=int, default=32, help="requests that may wait for a place; more get 429 (32)")
    p.add_argument("--strategy", choices=list(STRATEGIES), default="auto", help="a request's strategy when it names "
                                                                                "none (auto)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--quantize", choices=["auto", "none", "int8", "int4", "w7a8"], default="auto",
                   help="as the CLI's: auto takes int4 or w7a8 from a GGUF file's 4-bit codes "
                                                             "when --dtype is auto, whichever measures faster")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="as the CLI's: decoding steps as compiled graphs where they pass the exactness check and "
                        "measure faster here (auto), wherever they pass it (on), or never (off); answers are the "
                        "CLI's with the same setting")
    p.add_argument("--max-body", type=int, default=4 << 20, help="largest request body in bytes; larger get 413")
    p.add_argument("--prompt-cache-mb", type=int, default=512,
                   help="memory for finished requests' K/V, reused by prompts that begin with them (0: off; 512)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="ROWS",
                   help=f"prompt rows a new request feeds each shared pass while others run, at least: they wait at "
                        f"most one such pass for it ({PREFILL_CHUNK}, and {PREFILL_PER_REQUEST} per running request; "
                        f"{PREFILL_ALONE} while no other request runs)")
    p.add_argument("--plan", choices=["pass", "alone"], default="pass",
                   help="greedy auto requests size their drafts for the whole shared pass (pass, the default) or each "
                        "as if alone; only speed depends on it")
    p.add_argument("--shared-history", type=int, default=0, metavar="TOKENS",
                   help="greedy auto requests also draft from earlier requests' answers, up to TOKENS kept (0: off, "
                        "the default); only speed depends on it")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running answers may take to finish after SIGTERM (10)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    for name in ("max_concurrent", "queue", "max_body", "prefill_chunk"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.shared_history < 0:
        p.error("--shared-history must be >= 0")
    return args


def model_id(args: argparse.Namespace) -> str:
    if args.model_name:
        return args.model_name
    ckpt = args.ckpt or DEFAULT_CHECKPOINT
    return Path(ckpt).name if Path(ckpt).exists() else ckpt


def loader(args: argparse.Namespace):
    """What the server loads in the background: the model as the CLI loads it (exact by default, compiled steps
    where the CLI would run them, its checks and graphs kept per machine), and auto's step costs, measured once here
    instead of inside a request."""
    def load() -> Served:
        tables = kept_tables_dir()
        llm = LLM.load(args.ckpt, dtype=args.dtype, device=args.device, group_size=args.group_size, progress=False,
                       quantize=None if args.quantize == "none" else args.quantize,
                       compile={"on": True, "off": False}.get(args.compile, "auto"))
        costs = step_costs_for(llm.model, COST_SIZES, tables / "step_costs.json")
        # What is loaded now lives as long as the server: kept out of every later collection, each of which would
        # otherwise scan it all again (a full one 85-96 ms in the demo model's process, a pause of every stream;
        # 0.0 ms once frozen, measured).
        gc.freeze()
        return Served(llm, model_id(args), args.strategy, costs)
    return load


class Server(uvicorn.Server):
    """uvicorn's server, except that after a graceful shutdown on SIGTERM or SIGINT the process exits 0 (uvicorn
    raises the signal again once it has stopped, which ends the process with the signal's status)."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    limits = Limits(args.max_concurrent, args.queue, args.max_body, args.shutdown_timeout, args.prompt_cache_mb << 20,
                    args.prefill_chunk)
    planning = Planning(together=args.plan == "pass", history_tokens=args.shared_history)
    service = Service(loader(args), model_id(args), api_key=args.api_key, limits=limits, planning=planning)
    config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    server = Server(config)
    service.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run()
    if service.load_error:
        print(f"error: {service.load_error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
