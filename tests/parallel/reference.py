"""What the rank processes and the single-process reference both run, so that the two can be compared."""

from __future__ import annotations

import torch

from minilade.decoding.step_costs import StepCosts
from minilade.invariance import apply_exact_attention
from minilade.masks import CandidateTree, LookaheadLayout, StepShape
from minilade.model import Transformer

PROMPT = [3, 17, 5, 9, 3, 17, 5, 2, 11, 4, 3, 17]
GEN_PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 1, 2, 5, 6]
STEP_COSTS = StepCosts({1: 1.0, 64: 1.2})  # wide steps almost free: auto then drafts and uses the window
WORDS = "a b c d hello world"  # what the tiny checkpoints' tokenizer is trained on
TEXT_PROMPT = "hello world a b"
# Sampling at a temperature so small that it draws the argmax, with every penalty set: the tokens are then penalized
# greedy decoding's, whatever the seed.
PENALIZED = dict(temperature=1e-40, repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=1.0)


def lookahead_step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens (1, T), positions (T,) after PROMPT and the mask (T, T) of a lookahead step W=3, N=3, G=2."""
    layout = LookaheadLayout(3, 3, 2)
    tree = CandidateTree.build(torch.tensor([[4, 9], [4, 1]]))
    mask, offsets, _ = StepShape(layout, with_window=True, device=torch.device("cpu")).assemble(tree)
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(20, (layout.levels * layout.window,), generator=gen)
    base[0] = PROMPT[-1]
    return torch.cat([base, tree.tokens])[None], len(PROMPT) + offsets, mask


def prefill_and_step(model: Transformer, step: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (1, P, V) of the prompt, then (1, T, V) of the lookahead step after it, through the exact attention
    kernel."""
    cache = apply_exact_attention(model).new_cache(64)
    with torch.inference_mode():
        prefill = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), cache)
        cache.commit(len(PROMPT))
        tokens, positions, mask = step
        return prefill, model(tokens, positions, cache, mask)
