"""Penalties for repeating: repetition (Hugging Face), presence and frequency (OpenAI).

A penalty depends on the history before the token being chosen. For a verified draft row that history is the
committed text plus the draft's own tokens up to that row (TokenHistory.penalize with drafts), so lookahead stays
exact under penalties: greedy output is plain decoding's, sampling keeps its distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams


def penalize(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits (..., V) after the penalties, float32. seen: (..., V) bool, the token occurs in the prompt or the
    output before this row; counts: (..., V) float, its occurrences in the output. Elementwise only, so a row's
    result does not depend on how many rows are penalized with it."""
    logits = logits.float()
    p = params.repetition_penalty
    if p != 1.0:
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (counts > 0).float()
    return logits


class TokenHistory:
    """What the penalties need to know about one generation's text, kept on the device: which tokens occur in it
    (prompt included) and how often each occurs in the output."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int,
                 device: torch.device | str) -> None:
        self.params = params
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.seen[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True

    def add(self, tokens: Sequence[int]) -> None:
        """Output tokens, in order."""
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.counts.device)
        self.seen[ids] = True
        self.counts.index_add_(0, ids, torch.ones(len(ids), device=self.counts.device))

    def penalize(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits: (V',) the next token's after the history; or, with drafts (g, K) proposed to follow it,
        (g, K, V') where row [j, i] follows draft j's tokens 0..i, which then count as output too."""
        V = logits.shape[-1]  # the output head may be cut short of the vocabulary (llm.drop_padded_logits)
        seen, counts = self.seen[:V], self.counts[:V]
        if drafts is not None:
            extra = torch.nn.functional.one_hot(drafts.clamp(0, V - 1), V).cumsum(1).float()  # (g, K, V)
            seen, counts = seen | (extra > 0), counts + extra
        return penalize(logits, seen, counts, self.params)
