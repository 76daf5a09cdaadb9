"""Native steps' weight matmuls: the operator's own integer dot products against fbgemm's w7a8 call, in whole passes,
and on matrix tiles where the processor has them (AMX).

The demo model's layers and output head are registered with the native operator twice
(native_steps.register_layers), once with its codes laid out for the operator's integer matmul (what native steps
run) and once without (every matmul through fbgemm's call, the same bits), and the same work goes through each,
interleaved, in rounds: the layers over R rows of one call (a decoding step with drafts, causal) and over R calls of
one row each over caches of their own (a server's pass), after --context committed tokens a cache; and the final
norm and output head over R rows, also eagerly (the model's RMSNorm and W7A8Linear modules, as eager steps run
them); where the processor has matrix tiles, the operator's integer matmul on them too (the same registration, the
same bits). Medians of the rounds' medians; ratios are the other way's time over the operator's integer matmul's
(tiles: the integer matmul's over the tiles').

    python -m scripts.bench.native_matmul --rows 1 2 4 8 16 32
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

from minilade import LLM
from minilade.checkpoints import DEFAULT_CHECKPOINT
from minilade.native_steps import (
    NativeCall,
    NativeSteps,
    has_matrix_tiles,
    layers_pass,
    native_missing,
    register_layers,
    use_matrix_tiles,
)

from .common import JobParser, UsageError, describe_machine, environment, positive_int, progress, run_job

MODULE = "scripts.bench.native_matmul"


def passes(llm: LLM, rows: int, context: int) -> dict[str, Callable[[], Callable[[int | None], object]]]:
    """The three kinds of work of `rows` rows, each as a function that makes its inputs and returns what runs them
    under a registration's key: the layers over one call of `rows` rows, and over `rows` calls of one row with caches
    of their own (filled with `context` random tokens each); the final norm and output head over `rows` rows (key
    None: by the model's modules, eagerly)."""
    model = llm.model
    caches = []
    for i in range(rows):
        cache = model.new_cache(context + rows + 1)
        model(torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(i)),
              torch.arange(context)[None], cache)
        cache.commit(context)
        caches.append(cache)
    first, plural = caches[0], "s" if rows > 1 else ""
    x = torch.randn(rows, model.config.dim, generator=torch.Generator().manual_seed(rows))

    def layers(calls: Callable[[], list[NativeCall]]) -> Callable[[], Callable[[int], object]]:
        def make() -> Callable[[int], object]:
            made = calls()  # a call's rows go to the same slots every pass: its cache stays as it is
            return lambda key: layers_pass(model, made, key)
        return make

    return {
        f"{rows} row{plural}, 1 call": layers(lambda: [NativeCall(torch.arange(rows) + 5,
                                                                  torch.arange(rows) + first.length, first, None)]),
        f"{rows} call{plural} of 1 row": layers(lambda: [NativeCall(torch.tensor([5]), torch.tensor([c.length]), c,
                                                                    None) for c in caches]),
        f"head, {rows} row{plural}": lambda: lambda key: (model.output(model.norm(x[None])) if key is None else
                                                          torch.ops.minilade_native_layer.head(key, x)),
    }


def job(argv: list[str]) -> int:
    p = JobParser(MODULE, __doc__)
    p.add_argument("--ckpt", default=DEFAULT_CHECKPOINT)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--context", type=positive_int, default=250)
    p.add_argument("--rounds", type=positive_int, default=10)
    p.add_argument("--reps", type=positive_int, default=6, help="passes a round, the first two not timed")
    args = p.parse_args(argv)
    # Not chosen by the load (which would let go of the layers' and head's codes: native_steps.take_over), but
    # installed here, so that both registrations can be made.
    llm = LLM.load(args.ckpt, progress=False, quantize="w7a8", compile=False)
    missing = native_missing(llm.model)
    if missing:
        raise UsageError(f"native steps do not run here: {missing}")
    llm.model.step_runner = NativeSteps()  # its caches are the ones native passes read
    integer = register_layers(llm.model)
    # matmul -> (registration key, whether on matrix tiles)
    keys = {"integer": (integer, False), "fbgemm": (register_layers(llm.model, integer_matmul=False), False)}
    if has_matrix_tiles():
        keys["tiles"] = (integer, True)
    print(describe_machine(environment()))
    print(f"{llm.setup}; {torch.get_num_threads()} threads; {args.context} committed tokens a cache\n")
    samples: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        kinds = {name: make for rows in args.rows for name, make in passes(llm, rows, args.context).items()}
        with progress(args.rounds, "rounds") as bar:
            for _ in range(args.rounds):
                for name, make in kinds.items():
                    for matmul, (key, tiles) in [*keys.items(),
                                                 *([("eager", (None, False))] if name.startswith("head") else [])]:
                        use_matrix_tiles(tiles)
                        times = []
                        for _ in range(args.reps):
                            run = make()
                            start = time.perf_counter()
                            run(key)
                            times.append(time.perf_counter() - start)
                        samples.setdefault((name, matmul), []).append(statistics.median(times[2:]))
                bar.update()
    table = {name: {m: 1e3 * statistics.median(times) for (n, m), times in samples.items() if n == name}
             for name in kinds}
    use_matrix_tiles(False)
    tiles = "tiles" in keys
    print("| work | integer matmul, ms | fbgemm's call, ms | fbgemm / integer | eager, ms | eager / integer |"
          + (" matrix tiles, ms | integer / tiles |" if tiles else ""))
    print("| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if tiles else ""))
    for name, ms in table.items():
        eager = f"{ms['eager']:.2f} | x{ms['eager'] / ms['integer']:.2f}" if "eager" in ms else " | "
        print(f"| {name} | {ms['integer']:.2f} | {ms['fbgemm']:.2f} | x{ms['fbgemm'] / ms['integer']:.2f} | {eager} |"
              + (f" {ms['tiles']:.2f} | x{ms['integer'] / ms['tiles']:.2f} |" if tiles else ""))
    print(json.dumps({"setup": llm.setup, "context": args.context, "ms": table, **environment()}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_job(job, argv)


if __name__ == "__main__":
    sys.exit(main())
