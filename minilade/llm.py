"""The library's front door: load a checkpoint once, then generate or stream text many times.

    from minilade import LLM, Lookahead
    llm = LLM.load()                                      # the demo model; or a .gguf, a folder, an HF repo id
    out = llm.generate("Write a haiku about caches.", chat=True, max_new_tokens=64)
    print(out.text)
    print(out.stats.summary())
    stream = llm.stream("def fib(n):", strategy=Lookahead(window=7, ngram=5, guesses=7))
    for piece in stream:
        print(piece, end="", flush=True)
    print(stream.result.stats.compression)
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import torch

from .checkpoints import DEFAULT_CHECKPOINT, build_model, meta_model, open_checkpoint
from .checkpoints.generation_config import defaults_from_hf, merge_sampling, read_generation_defaults
from .checkpoints.hf import config_from_hf
from .checkpoints.resolve import CHECK_TABLE, COST_TABLE
from .decoding import Auto, GenerationSettings, Strategy, make_strategy
from .decoding.loop import check_prompt, fitted_strategy
from .decoding.step_costs import quantized_layers
from .device import choose_dtype, choose_quantization, make_exact
from .integer_linear import pack_layers, w7a8_missing
from .kv_cache import KVCache
from .loading import device_and_dtype, drop_padded_logits, gguf_codes, has_int4_codes, tables_dir
from .memory import collection_paused, returning_freed_memory
from .model import Transformer
from .native_steps import NativeSteps, take_over
from .parallel import load_shard, process_group
from .quant import check_options, quantize_embedding, quantize_linears
from .text_stream import Generation, TextStream
from .tokenizer import Tokenizer

Messages = list[dict[str, str]]
Prompt = Union[str, Sequence[int], Messages]


class LLM:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, name: str = "",
                 generation_defaults: dict[str, Any] | None = None, *, tables: Path | None = None) -> None:
        """generation_defaults: the checkpoint's own sampling settings (checkpoints/generation_config.py),
        used for every option a generation does not set.
        tables: the folder where what is measured on this machine is kept (see load); None: nowhere."""
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.generation_defaults = dict(generation_defaults or {})
        self.tables = tables
        self.setup = ""  # how the model runs, in a few words (dtype, quantized layers, eager or compiled steps)
        self._spare_cache: KVCache | None = None  # reused by the next generation; None while one holds it
        self._spare_ids: tuple[int, ...] = ()  # the tokens whose K/V its first rows hold, with a prefill's bits
        self._spare_writers: tuple = ()  # the model's step runner and attention kernel when they were written
        self._spare_lock = threading.Lock()  # generations in several threads take and give back one at a time
        self._home = threading.current_thread()  # where the model was loaded (other_thread_warning)

    @property
    def cost_file(self) -> str | None:
        """Where auto keeps the step costs it measures (None: measured once per process)."""
        return str(self.tables / COST_TABLE) if self.tables is not None else None

    @classmethod
    @returning_freed_memory
    @collection_paused()
    def load(cls, ckpt: str | Path | None = None, *, dtype: str | torch.dtype | None = None,
             device: str | torch.device | None = None, progress: bool = True, exact: bool = True,
             tables: str | Path | bool = True, quantize: str | None = "auto", group_size: int = 32,
             compile: bool | str = "auto", tensor_parallel: bool = False) -> LLM:
        """ckpt: a .gguf file, a folder with config.json and safetensors, a Hugging Face repo id
        (owner/name[@revision]), or None for the demo model (downloaded on first use).
        dtype: float32, bfloat16, float16 (CUDA only) or None for the device's fast default.
        exact: make every step batch-invariant, so lookahead's output is exactly plain decoding's (device.make_exact:
        the invariant attention kernel, weight matmuls in measured row tilings, checked at load); on the CPU, dtype
        None/"auto" then picks the fastest dtype that passes the check, measured. False keeps the stock kernels (for
        kernel benchmarks).
        tables: the folder where what is measured on this machine is kept between runs: the check's verdicts and
        the dtype chosen (invariance.json), auto's step costs (step_costs.json). True (the default): where the
        command line keeps them (checkpoints.resolve.kept_tables_dir: $MINILADE_TABLES, else beside the demo
        weights), so a load after the first takes about a second, not half a minute. False: kept nowhere (the
        check at every load, step costs measured once per process). Or a folder of the caller's.
        quantize: "int8" (per output channel) or "int4" (groups of group_size inputs) keeps the linear layers
        quantized (CPU only, bfloat16 inside the layer, see quant.py), and the token embedding as int8 in groups
        of 32; int4 in groups of 32 takes a GGUF file's Q4_0/Q4_1 codes as they are, and the embedding its Q8_0
        codes. "w7a8": 7-bit weights per output channel and 8-bit activations per row in integer matmuls (x86,
        integer_linear.py), whose extra rows cost little. "auto" (the default): when dtype is auto and a GGUF
        file keeps weights in Q4_0/Q4_1 codes, int4 (the file's own rounding, nothing more) or w7a8 from those
        codes, whichever steps faster here (measured once, kept in tables), else nothing quantized. None: nothing
        quantized.
        compile: run the decoding steps as compiled graphs (compiled.py, CPU): "auto" (the default) where they pass
        the exactness check and measure faster than eager steps on this machine, True whenever they pass the check,
        False never. With tables, the first load on a machine compiles them (under a minute for the demo model on 2
        cores) and later processes load them in some 5 s; without, every process traces them again.
        `self.setup` says what was chosen (docs/benchmarks.md).
        tensor_parallel: this process is one rank of a run launched by torchrun; it loads and runs only its shard
        (minilade/parallel; dtype auto is float32 on the CPU, the check is made at every load, no quantization)."""
        if quantize not in (None, "auto"):
            check_options(quantize, group_size)
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
        measure_dtype = dtype in (None, "auto")
        device, dtype = device_and_dtype(device, dtype)
        tables = tables_dir(tables)
        if tensor_parallel:
            if quantize not in (None, "auto"):
                raise ValueError("quantize does not combine with tensor parallelism (yet): leave it out")
            model, tokenizer, name = load_shard(ckpt if ckpt is not None else DEFAULT_CHECKPOINT, dtype=dtype,
                                                device=device, progress=progress)
            llm = cls.prepared(model, tokenizer, name, exact=exact)  # a shard is checked at every load
            llm.tables = tables
            return llm
        checkpoint = open_checkpoint(ckpt if ckpt is not None else DEFAULT_CHECKPOINT, progress=progress)
        metadata = checkpoint.source.metadata if checkpoint.format == "gguf" else None
        tokenizer = Tokenizer.from_checkpoint(checkpoint.path, gguf_metadata=metadata)
        defaults = read_generation_defaults(checkpoint.path)
        if quantize == "auto":  # a file's int4 codes: as int4 or as w7a8 layers, whichever measures faster
            modes = ("int4", "w7a8") if w7a8_missing() is None else ("int4",)
            quantize, group_size = (modes if measure_dtype and has_int4_codes(checkpoint) else None), 32
        codes = quantize if isinstance(quantize, str) else "int4"  # w7a8 takes the int4 codes' values too
        blocks = (gguf_codes(checkpoint, meta_model(checkpoint.config), tokenizer.vocab_size, codes, group_size)
                  if quantize else {})
        # Layers that take the file's codes are never read as floats (the embedding is: a tied head needs it).
        given = {f"{name}.weight" for name in blocks if name != "tok_embeddings"}
        model = checkpoint.load_model(dtype=dtype, device=device, given=given)
        llm = cls.prepared(model, tokenizer, str(checkpoint.path), exact=exact, measure_dtype=measure_dtype,
                           tables=tables, quantize=quantize, group_size=group_size, blocks=blocks, compile=compile)
        llm.generation_defaults = defaults
        return llm

    @classmethod
    def from_transformers(cls, model: Any, tokenizer: Any, *, dtype: str | torch.dtype | None = None,
                          device: str | torch.device | None = None, exact: bool = True,
                          tables: str | Path | bool = True) -> LLM:
        """An LLM over a loaded transformers LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM and its tokenizer.

        Weights are taken, not re-read from disk: where dtype and device stay those of the transformers model
        (the default), the embedding, norms and output projections are the very same tensors, and only q/k/v and
        gate/up are copied once into their fused matrices. The tokenizer's files, chat template and special
        tokens go through the same reader as a checkpoint folder's; the model's generation_config supplies the
        sampling defaults as a checkpoint's generation_config.json does. tables: as for load."""
        first = next(model.parameters())
        device, dtype = device_and_dtype(device if device is not None else first.device,
                                         dtype if dtype is not None else first.dtype)
        with tempfile.TemporaryDirectory(prefix="minilade-") as folder:
            tokenizer.save_pretrained(folder)
            model.config.save_pretrained(folder)  # eos/bos ids that the tokenizer reader also looks at
            ours_tokenizer = Tokenizer.from_checkpoint(folder)
        config = config_from_hf(model.config.to_dict())
        generation = getattr(model, "generation_config", None)  # its sampling defaults, as generation_config.json's
        defaults = defaults_from_hf(generation.to_dict()) if generation is not None else {}
        ours = build_model(config, model.state_dict().items(), dtype=dtype, device=device)
        llm = cls.prepared(ours, ours_tokenizer, type(model).__name__, exact=exact, tables=tables_dir(tables))
        llm.generation_defaults = defaults
        return llm

    @classmethod
    def prepared(cls, model: Transformer, tokenizer: Tokenizer, name: str, *, exact: bool = True,
                 measure_dtype: bool = False, tables: Path | None = None,
                 quantize: str | tuple[str, ...] | None = None,
                 group_size: int = 32, blocks: dict | None = None, compile: bool | str = False) -> LLM:
        """The last steps of loading: the output head cut to the tokenizer's vocabulary; linear layers and the
        embedding quantized when asked (taking `blocks`, a file's own codes by module name, as they are; a tuple of
        modes: the fastest exact one, measured, device.choose_quantization); the
        model made exact when `exact` (in the fastest exact dtype when measure_dtype and nothing is quantized, see
        device.choose_dtype), else left with the stock kernels; its steps compiled as `compile` says (see load); what
        that measures is kept in `tables`."""
        drop_padded_logits(model, tokenizer.vocab_size)
        check_file = tables / CHECK_TABLE if tables is not None else None
        chose = ""
        if isinstance(quantize, tuple) and exact and len(quantize) > 1:
            model, chose = choose_quantization(model, dict(blocks or {}), quantize, check_file,
                                               native=compile == "auto")
        elif quantize is not None:
            blocks = dict(blocks or {})
            quantize_linears(model, quantize if isinstance(quantize, str) else quantize[0], group_size,
                             weights=blocks)
            quantize_embedding(model, blocks.pop("tok_embeddings", None))
        if exact and measure_dtype and quantize is None and model.device.type == "cpu":
            model = choose_dtype(model, check_file)
        elif exact:
            make_exact(model, check_file)
        steps = "eager steps"
        if exact and compile:
            from .compile_policy import choose_steps  # torch.compile's machinery, imported only when asked for
            steps = choose_steps(model, check_file, force=compile is True)
        if isinstance(model.step_runner, NativeSteps):
            take_over(model)  # the layers' codes let go: native passes read their own copy
        else:
            pack_layers(model)  # w7a8 layers' codes packed for fbgemm's kernel on several threads, not one at a time
        llm = cls(model, tokenizer, name, tables=tables)
        quantized = quantized_layers(model)
        llm.setup = f"{str(model.dtype).removeprefix('torch.')}{f' ({quantized})' if quantized else ''}, {steps}" \
                    f"{f'; {chose}' if chose else ''}"
        return llm

    def drop_kept_rows(self) -> None:
        """Forget the K/V the last generation left (TextStream), so that the next one reads its whole prompt: for
        timing a prompt's prefill, or strategies side by side on one prompt, as each runs alone."""
        with self._spare_lock:
            self._spare_ids = ()

    def _take_cache(self) -> tuple[KVCache | None, tuple[int, ...]]:
        """The spare cache (None while a generation holds it) and the tokens whose K/V its first rows hold, with
        the bits a prefill gives them (none where the model's step runner or attention kernel changed since)."""
        with self._spare_lock:
            cache, ids, writers = self._spare_cache, self._spare_ids, self._spare_writers
            self._spare_cache, self._spare_ids, self._spare_writers = None, (), ()
        same = len(writers) == 2 and all(a is b for a, b in zip(writers, self._writers()))
        return cache, ids if cache is not None and same else ()

    def _give_back_cache(self, cache: KVCache, ids: tuple[int, ...] = ()) -> None:
        with self._spare_lock:
            self._spare_cache, self._spare_ids, self._spare_writers = cache, ids, self._writers()

    def _writers(self) -> tuple:
        """What decides the bits of the K/V a generation writes: the model's step runner and attention kernel."""
        return self.model.step_runner, self.model.attention_kernel

    def encode(self, prompt: Prompt, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a prompt: text (through the chat template when chat is set), chat messages, or ids
        (used as they are: chat and system do not apply to them)."""
        if isinstance(prompt, str):
            if not chat:
                if system:
                    raise ValueError("a system message needs chat=True (it goes through the chat template)")
                return self.tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):
            messages = ([{"role": "system", "content": system}] if system else []) + list(prompt)
            return self.tokenizer.encode_chat(messages)
        if chat or system:
            raise ValueError("chat and system apply to text or chat messages, not to token ids")
        return list(prompt)

    def generate(self, prompt: Prompt, **options: Any) -> Generation:
        """Generate to the end; options as for prepare()."""
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: Prompt, **options: Any) -> TextStream:
        """An iterator of text pieces; its .result holds the Generation once it is exhausted. Options as for
        prepare(), checked before anything runs."""
        prompt_ids, settings = self.prepare(prompt, **options)
        self.other_thread_warning()
        return TextStream(self, prompt_ids, settings)

    def generate_many(self, prompts: Sequence[Prompt], *, concurrency: int = 8, progress: bool = False,
                      on_done: Callable[[int, Generation], None] | None = None, **options: Any) -> list[Generation]:
        """generate() for every prompt, up to `concurrency` generations at a time sharing each forward pass (the
        server's engine, serve/engine.py, its passes run in this thread): one Generation per prompt, in order, each
        the one generate() gives that prompt alone (greedy, or sampled with a seed). Options as for prepare(), the
        same for every prompt; every prompt and option is checked before anything runs. A generation that fails
        ends the others, and its error is raised. progress: a bar on stderr counting the finished generations.
        on_done(index, generation): called as each generation finishes (from a worker thread, one call at a time),
        for a caller that hands results on before the last one ends. Where the model's steps are compiled graphs,
        the first call compiles the graphs of the passes the generations share (kept, as the server keeps them)
        and checks them; later calls reuse the check.
        One process's model only (not one split over ranks)."""
        from .many import answer_all  # it imports this module

        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
        if process_group(self.model) is not None:
            raise ValueError("generate_many runs a model in one process, not one split over ranks; generate each "
                             "prompt in turn")
        prepared = []
        for prompt in prompts:
            prompt_ids, settings = self.prepare(prompt, **options)
            check_prompt(prompt_ids, self.model)
            prepared.append((prompt_ids, self.with_step_costs(prompt_ids, settings)))
        self.other_thread_warning()
        return answer_all(self, prepared, concurrency, progress, on_done)

    def with_step_costs(self, prompt_ids: list[int], settings: GenerationSettings) -> GenerationSettings:
        """settings whose auto strategy carries the step costs its decoder would measure on this model alone, for
        a generation in the engine, which sees a proxy of the model that cannot time a step: the same costs give the
        same plans, and a sampled answer depends on its plans."""
        strategy = settings.strategy
        if not isinstance(strategy, Auto) or strategy.costs is not None:
            return settings
        costs = fitted_strategy(self.model, len(prompt_ids), settings).step_costs(self.model)
        return dataclasses.replace(settings, strategy=dataclasses.replace(strategy, costs=costs))

    def prepare(self, prompt: Prompt, *, chat: bool = False, system: str | None = None, max_new_tokens: int = 256,
                temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                repetition_penalty: float | None = None, presence_penalty: float | None = None,
                frequency_penalty: float | None = None, seed: int | None = None, stop: Sequence[str] | str = (),
                strategy: Strategy | str = "auto") -> tuple[list[int], GenerationSettings]:
        """One generation's prompt token ids and settings, checked: what stream() runs and generate_many() queues.
        Sampling options left None take the checkpoint's generation defaults (self.generation_defaults), else
        greedy decoding without penalties (sampling.SamplingParams says what each means). The default strategy,
        auto, is lookahead shaped from measured step costs (plain decoding's output, or its distribution when
        sampling), with its step costs kept in self.tables (also for an Auto given without a cost_file);
        "autoregressive" is plain decoding."""
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed)
        if isinstance(strategy, str):
            strategy = make_strategy(strategy, cost_file=self.cost_file)
        elif isinstance(strategy, Auto) and strategy.cost_file is None and self.cost_file is not None:
            strategy = dataclasses.replace(strategy, cost_file=self.cost_file)
        settings = GenerationSettings(
            strategy=strategy,
            sampling=merge_sampling(self.generation_defaults, given), max_new_tokens=max_new_tokens, stop=stop)
        return self.encode(prompt, chat=chat, system=system), settings

    def other_thread_warning(self) -> None:
        """Warn once when a generation on the CPU starts in another thread than the one that loaded the model
        while that one lives. torch gives each thread that runs a parallel operation an OpenMP pool of its own, and
        while two pools live, every parallel operation waits longer for its threads (libgomp keeps idle threads
        spinning only briefly once they outnumber the cores): on 2 cores a compiled one-row step of the demo model
        took 17.5 ms in a second thread against 7.5 ms in the loading one. A thread that ends takes its pool with
        it, so loading in a thread that ends, or generating where the model was loaded, avoids it."""
        home, here = self._home, threading.current_thread()
        if home is None or here is home or not home.is_alive() or self.model.device.type != "cpu":
            return
        self._home = None  # once
        warnings.warn(f"minilade: generating in thread {here.name!r}, while {home.name!r}, which loaded the model, "
                      f"still runs: two OpenMP pools can make each step several times slower; generate in the "
                      f"loading thread, or load in a thread that ends", RuntimeWarning, stacklevel=3)
