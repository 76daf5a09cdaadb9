"""Command line: python -m minilade.generate [PROMPT] [options]

Streams the generated text to stdout and a one-line statistics summary to stderr. The prompt comes from the
argument or from stdin; --interactive starts a chat; --prompts FILE generates for every prompt of a JSON Lines
file, several at a time sharing each forward pass, one JSON object a line out. Errors are one line on stderr and
a non-zero exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from .checkpoints import DEFAULT_CHECKPOINT
from .checkpoints.generation_config import check_sampling, merge_sampling
from .checkpoints.resolve import COST_TABLE, kept_tables_dir
from .checkpoints.support import describe_support
from .decoding import STRATEGIES, GenerationSettings, make_strategy
from .decoding.loop import check_prompt
from .errors import CheckpointError, TokenizerError, UnsupportedModelError
from .llm import LLM
from .parallel import end_run, launched_with_ranks, quiet_unless_leader, read_on_leader
from .quant import check_options
from .sampling import SamplingParams
from .text_stream import Generation, TextStream

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minilade.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    p.add_argument("--list-models", action="store_true",
                   help="list the model families, rope scalings, GGUF tensor types and vocabularies minilade runs, "
                        "and exit")
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT,
                   help=f"a .gguf file, a folder with config.json + safetensors, a Hugging Face repo id "
                        f"(owner/name[@revision]), or {DEFAULT_CHECKPOINT} (default; downloaded on first use)")
    p.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template to the prompt")
    p.add_argument("--system", help="system message for --chat and --interactive")
    p.add_argument("--interactive", "-i", action="store_true",
                   help="chat turn by turn on the terminal (a turn reads only what the last one left unread: the "
                        "conversation's K/V are kept)")
    p.add_argument("--prompts", metavar="FILE",
                   help="generate for every prompt of a JSON Lines file ('-': stdin), each line a string or an "
                        "object with \"prompt\" (a string) or \"messages\" (chat messages); prints one JSON object "
                        "a line, in the file's order, each the answer its prompt gets alone")
    p.add_argument("--concurrency", type=int, default=8,
                   help="with --prompts: generations at once, sharing each forward pass (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    g = p.add_argument_group("sampling (default: the checkpoint's generation_config.json, else greedy without "
                             "penalties; each option overrides it)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="0 = off")
    g.add_argument("--top-p", type=float, default=None, help="1 = off")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 0; divides a positive logit (multiplies a negative one) of every token already in the text "
                        "(1 = off)")
    g.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]; off 0")
    g.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2], per occurrence; off 0")
    g.add_argument("--seed", type=int, default=None)
    s = p.add_argument_group("decoding strategy")
    s.add_argument("--strategy", choices=list(STRATEGIES), default="auto",
                   help="auto (default): lookahead shaped step by step from the measured cost of a step on this "
                        "machine (W, N, G then bound the largest step), plain decoding where lookahead does not pay; "
                        "autoregressive: plain decoding, one token per forward pass")
    s.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="how the decoding steps of every strategy run (CPU). auto (default): as native C++ layers "
                        "for w7a8 models in float32 (built once a machine, some 20 s on 2 cores), else as compiled "
                        "graphs (torch.compile: the first run on a machine compiles them, under a minute on 2 cores; "
                        "later runs load them in some 5 s), where they pass the exactness check and measure faster "
                        "than eager steps here; on: compiled graphs wherever they pass the check; off: eager steps")
    add_strategy_options(s)
    d = p.add_argument_group("hardware")
    d.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (CUDA only)")
    d.add_argument("--quantize", choices=["auto", "none", "int8", "int4", "w7a8"], default="auto",
                   help="keep weights quantized (CPU): linear layers int8 per channel, int4 in groups, or w7a8 "
                        "(integer matmuls, cheap wide steps); the embedding int8 in groups of 32. auto (default): "
                        "with --dtype auto and a GGUF file in 4-bit codes, int4 (the codes as they are) or w7a8, "
                        "whichever measures faster here; else none")
    d.add_argument("--group-size", type=int, default=32, help="int4 group size: 32, 64, 128 or 256")
    d.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, statistics)")
    return p


def strategy_fields() -> dict[str, tuple[dataclasses.Field, list[str]]]:
    """Every strategy setting that is a command-line option (its field's metadata says so: decoding.base.option),
    with the names of the strategies that have it."""
    found: dict[str, tuple[dataclasses.Field, list[str]]] = {}
    for name, kind in STRATEGIES.items():
        for f in dataclasses.fields(kind):
            if "help" in f.metadata:
                found.setdefault(f.name, (f, []))[1].append(name)
    return found


def add_strategy_options(group: argparse._ArgumentGroup) -> None:
    """One option per strategy field that asks for one; its default and help are the field's."""
    for name, (f, owners) in strategy_fields().items():
        flags = f.metadata["flags"] or (f"--{name.replace('_', '-')}",)
        default = f"default {f.default}" if f.default is not None and not isinstance(f.default, bool) else ""
        where = ", ".join(owners)
        help = f"{f.metadata['help']} ({where}{'; ' + default if default else ''})"
        if isinstance(f.default, bool):
            group.add_argument(*flags, dest=name, action="store_const", const=not f.default, default=None, help=help)
        else:
            group.add_argument(*flags, dest=name, type=int, default=None, metavar=f.metadata["metavar"], help=help)


def settings_from_args(args: argparse.Namespace) -> GenerationSettings:
    """The generation settings the options ask for, checked before any weights are loaded. An option the chosen
    strategy does not have is an error. Step costs for `auto` are measured once per machine and kept."""
    given = {name: getattr(args, name) for name in strategy_fields() if getattr(args, name) is not None}
    for name, (_, owners) in strategy_fields().items():
        if name in given and args.strategy not in owners:
            raise ValueError(f"--{name.replace('_', '-')} applies to --strategy {' or '.join(owners)}, "
                             f"not {args.strategy}")
    strategy = make_strategy(args.strategy, cost_file=str(kept_tables_dir() / COST_TABLE), **given)
    check_sampling(sampling_options(args))
    return GenerationSettings(strategy, SamplingParams(), args.max_new_tokens, tuple(args.stop))


def sampling_options(args: argparse.Namespace) -> dict:
    """The sampling options given on the command line (None: not given, the checkpoint's default applies)."""
    names = ("temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def with_checkpoint_defaults(llm: LLM, args: argparse.Namespace, settings: GenerationSettings) -> GenerationSettings:
    """The settings once the checkpoint is loaded: its generation defaults under the options given."""
    return dataclasses.replace(settings, sampling=merge_sampling(llm.generation_defaults, sampling_options(args)))


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if sys.stdin.isatty():
        raise ValueError("no prompt: pass it as an argument, pipe it on stdin, or use --interactive")
    return sys.stdin.read()


def stream_to_stdout(stream) -> Generation:
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    return stream.result


def run_once(llm: LLM, args: argparse.Namespace, settings: GenerationSettings) -> None:
    prompt = read_on_leader(llm.model, lambda: read_prompt(args))  # only rank 0 reads stdin (tensor parallel)
    stream = TextStream(llm, llm.encode(prompt, chat=args.chat, system=args.system), settings)
    if args.json:
        for _ in stream:
            pass
        print(json.dumps({**stream.result.as_dict(), "setup": llm.setup}, ensure_ascii=False))
        return
    result = stream_to_stdout(stream)
    print(flush=True)
    print(summary_line(result) + f", finish: {result.finish_reason}; model {llm.setup}", file=sys.stderr)


def read_prompts(path: str) -> list[tuple[int, str | list[dict]]]:
    """(line number, prompt) for every non-empty line of a JSON Lines file ('-': stdin): a string, or an object with
    a "prompt" string or a "messages" list of chat messages."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    prompts: list[tuple[int, str | list[dict]]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n} is not JSON ({e.msg})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            item = item["prompt"]
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"] and all(
                isinstance(m, dict) for m in item["messages"]):
            item = item["messages"]
        elif not isinstance(item, str):
            raise ValueError(f'{path} line {n}: expected a string, or an object with "prompt" (a string) or '
                             f'"messages" (a list of chat messages)')
        prompts.append((n, item))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def many_prompts(args: argparse.Namespace) -> list[tuple[int, str | list[dict]]] | None:
    """--prompts' prompts, read and checked with its options before any weights are loaded (None without it)."""
    if args.prompts is None:
        return None
    if args.prompt is not None or args.interactive:
        raise ValueError("--prompts takes the prompts from its file: give no prompt argument and no --interactive")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    return read_prompts(args.prompts)


def run_many(llm: LLM, args: argparse.Namespace, settings: GenerationSettings,
             prompts: list[tuple[int, str | list[dict]]]) -> None:
    """--prompts: every prompt encoded and checked first (a bad one is named by its line), then generate_many; one
    JSON object a line on stdout, in the file's order, each printed once it and those before it have finished, and a
    summary on stderr."""
    ids = []
    for n, prompt in prompts:
        try:
            ids.append((n, llm.encode(prompt, chat=args.chat and isinstance(prompt, str), system=args.system)))
            check_prompt(ids[-1][1], llm.model)
        except ValueError as e:
            raise ValueError(f"{args.prompts} line {n}: {e}") from None
    waiting: dict[int, Generation] = {}  # finished out of order, until those before them finish
    printed = 0

    def print_in_order(i: int, result: Generation) -> None:  # one call at a time (generate_many's on_done)
        nonlocal printed
        waiting[i] = result
        while printed in waiting:
            print(json.dumps({"line": ids[printed][0], **waiting.pop(printed).as_dict()}, ensure_ascii=False),
                  flush=True)
            printed += 1

    start = time.perf_counter()
    results = llm.generate_many([p for _, p in ids], concurrency=args.concurrency, progress=True,
                                on_done=print_in_order, strategy=settings.strategy,
                                max_new_tokens=settings.max_new_tokens, stop=settings.stop, **sampling_options(args))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    print(f"{len(results)} prompts, {tokens} new tokens in {seconds:.2f} s ({tokens / seconds:.1f} tokens/s), up to "
          f"{args.concurrency} at once; model {llm.setup}", file=sys.stderr)


def summary_line(result: Generation) -> str:
    """The statistics line: the generation's summary and the process's peak memory so far."""
    memory = "" if result.peak_memory is None else f", peak memory {result.peak_memory / 2**20:.0f} MiB"
    return result.stats.summary() + memory


def run_interactive(llm: LLM, args: argparse.Namespace, settings: GenerationSettings) -> None:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("minilade chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = read_on_leader(llm.model, lambda: input("> "))
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        try:
            result = stream_to_stdout(TextStream(llm, encode_recent_turns(llm, messages), settings))
        except ValueError as error:  # this turn cannot be answered (too long, bad text): say so and go on
            print(f"error: {error}", file=sys.stderr)
            messages.pop()
            continue
        print(flush=True)
        print(summary_line(result), file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})


def encode_recent_turns(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's prompt ids, dropping the oldest exchanges (never the system message or the newest user
    turn) while it leaves less than a quarter of the context to answer in; says so on stderr when it drops."""
    room = llm.model.config.max_seq_len * 3 // 4
    ids = llm.encode(messages)
    first = 1 if messages[0]["role"] == "system" else 0
    while len(ids) > room and len(messages) - first > 1:
        del messages[first:first + 2]  # the oldest user turn and the assistant's answer to it
        ids = llm.encode(messages)
        print("minilade: the conversation outgrew the context; dropped the oldest exchange", file=sys.stderr)
    return ids


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_models:
        print(describe_support())
        return 0
    try:
        settings = settings_from_args(args)
        prompts = many_prompts(args)
        quantize = None if args.quantize == "none" else args.quantize
        if quantize not in (None, "auto"):
            check_options(quantize, args.group_size)
        llm = LLM.load(args.ckpt, dtype=args.dtype, device=args.device, quantize=quantize,
                       group_size=args.group_size, compile={"on": True, "off": False}.get(args.compile, "auto"),
                       tensor_parallel=launched_with_ranks(os.environ))
        settings = with_checkpoint_defaults(llm, args, settings)
        with quiet_unless_leader(llm.model):  # under torchrun, only rank 0 writes
            if prompts is not None:
                run_many(llm, args, settings, prompts)
            elif args.interactive:
                run_interactive(llm, args, settings)
            else:
                run_once(llm, args, settings)
        return end_run(0, finished=True)
    except (ValueError, CheckpointError, TokenizerError, UnsupportedModelError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return end_run(EXIT_USAGE)
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return end_run(130)


def console(argv: Sequence[str] | None = None) -> int:
    """The `minilade` command: `minilade serve [options]` is python -m minilade.serve, anything else
    python -m minilade.generate (`minilade -- serve` generates from the prompt "serve")."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["serve"]:
        return main(argv)
    try:
        from .serve.__main__ import main as serve
    except ImportError as e:
        print(f"error: the server needs the serve extra (pip install 'minilade[serve]'): {e}", file=sys.stderr)
        return EXIT_USAGE
    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
