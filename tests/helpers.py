"""Small shared builders for tests."""

from __future__ import annotations

from typing import Sequence

import torch

from minilade.config import ModelConfig
from minilade.engine import GenerationStats, TokenRun, decode_tokens
from minilade.model import Transformer
from minilade.sampling import SamplingParams
from minilade.strategies import Strategy


def tiny_model(vocab: int = 16, seed: int = 0, std: float = 0.3, preset: str = "tiny-gqa",
               dtype: torch.dtype = torch.float32) -> Transformer:
    """A random tiny model. A small vocabulary and large weights make its greedy output repetitive,
    so lookahead finds n-grams to verify."""
    config = ModelConfig.preset(preset).replace(vocab_size=vocab)
    return Transformer(config).init_random(seed=seed, std=std).to(dtype).eval()


def run_tokens(model: Transformer, prompt: Sequence[int], strategy: Strategy, *, max_new_tokens: int = 40,
               sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = ()) -> tuple[list[int], TokenRun]:
    run = TokenRun(GenerationStats())
    tokens = list(decode_tokens(model, prompt, run, strategy=strategy, sampling=sampling,
                                max_new_tokens=max_new_tokens, eos_ids=eos_ids))
    return tokens, run
