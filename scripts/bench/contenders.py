"""What a side-by-side comparison compares: each row is a Contender, a minilade strategy or a transformers generate
call on the same checkpoint, and a Runner runs one on one prompt, timing the whole generate call (prefill
included) for both libraries alike."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minilade import LLM, Lookahead, Strategy

from .common import Setting, UsageError, setting_text

AR, HF_GENERATE, HF_PROMPT_LOOKUP, HF_PREFILL, AUTO = (
    "minilade AR", "transformers generate", "transformers prompt lookup", "transformers prefill", "auto")


@dataclass(frozen=True)
class Contender:
    """One row of a comparison."""

    label: str
    library: str                      # "minilade" or "transformers"
    strategy: Strategy | None = None  # minilade: how it decodes
    prompt_lookup: int = 0            # transformers: prompt_lookup_num_tokens (0 = plain greedy generate)
    setting: Setting | None = None    # lookahead (W, N, G)
    max_new_tokens: int | None = None  # overrides the budget (transformers prefill-only timing)


def lookahead_contender(setting: Setting) -> Contender:
    return Contender(f"lookahead ({setting_text(setting)})", "minilade", Lookahead(*setting), setting=setting)


@dataclass
class Run:
    """One generate call: the new token ids and its wall time; the minilade fields stay None for transformers."""

    new_ids: list[int]
    wall_s: float
    forward_passes: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    finish_reason: str = ""
    tokens_per_step: dict[int, int] = field(default_factory=dict)


class Runner:
    """Runs one contender on one prompt (token ids) and times the whole generate call."""

    def __init__(self, llm: LLM, hf_model: Any) -> None:
        self.llm, self.hf_model = llm, hf_model
        self.eos_ids = list(llm.tokenizer.eos_ids)

    def __call__(self, contender: Contender, ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int) -> Run:
        budget = contender.max_new_tokens or max_new_tokens
        if contender.library == "minilade":
            return self._minilade(contender, ids, budget, temperature, seed)
        return self._transformers(contender, ids, budget)

    def _minilade(self, contender: Contender, ids: list[int], budget: int, temperature: float, seed: int) -> Run:
        self.llm.drop_kept_rows()  # each contender reads the whole prompt, as it does alone
        start = time.perf_counter()
        out = self.llm.generate(ids, max_new_tokens=budget, strategy=contender.strategy, temperature=temperature,
                                seed=seed if temperature > 0 else None)
        wall = time.perf_counter() - start
        s = out.stats
        return Run(out.token_ids, wall, s.forward_passes, s.prefill_s, s.decode_s, out.finish_reason,
                   {int(k): v for k, v in sorted(s.tokens_per_step.items())})

    def _transformers(self, contender: Contender, ids: list[int], budget: int) -> Run:
        extra = {"prompt_lookup_num_tokens": contender.prompt_lookup} if contender.prompt_lookup else {}
        eos = self.eos_ids
        with torch.inference_mode():
            start = time.perf_counter()
            input_ids = torch.tensor([ids])
            out = self.hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=budget,
                                         do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None,
                                         **extra)
            wall = time.perf_counter() - start
        new = out[0, len(ids):].tolist()
        return Run(new, wall, finish_reason="eos" if new and new[-1] in eos else "length")


def import_transformers() -> Any:
    """The transformers module, quiet; a one-line usage error where it is not installed."""
    try:
        import transformers
    except ImportError:
        raise UsageError('transformers is not installed: pip install -e ".[bench]" (or pass --no-transformers)') \
            from None
    transformers.logging.set_verbosity_error()
    return transformers


def load_hf_model(ckpt_path: Path, dtype: str) -> Any:
    """The same checkpoint in transformers: a .gguf file (dequantised by transformers) or a folder."""
    transformers = import_transformers()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    auto = transformers.AutoModelForCausalLM
    if ckpt_path.suffix == ".gguf":
        model = auto.from_pretrained(ckpt_path.parent, gguf_file=ckpt_path.name, dtype=torch_dtype)
    else:
        model = auto.from_pretrained(ckpt_path, dtype=torch_dtype)
    return model.eval()
