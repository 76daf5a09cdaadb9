"""Verification: which candidate tokens does the model itself produce, and what does it produce next?

Both functions run on the device and return small tensors; the caller reads them back in one transfer.
Notation: candidates (g, K), all proposed to follow the input token x; candidate j is its first lengths[j] tokens
(1..K; None: all K), the rest of its row is padding that is never accepted. A path never accepts past its own end,
and a wholly accepted path is still followed by the model's next token (the bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import CandidateTree
from .sampling import Sampler, largest


@dataclass(frozen=True)
class Verdict:
    """What verification decided in one step, on the host.

    emitted: the step's tokens (the accepted candidate tokens, then the model's next token). winner: the index of
    the accepted candidate (meaningful when n_accepted > 0). matches: per candidate, its leading tokens equal to
    the model's argmax chain (what a greedy walk would accept; the draft calibration learns from it).
    """

    emitted: list[int]
    winner: int
    n_accepted: int
    matches: list[int]


def verify_tree(sampler: Sampler, x_logits: torch.Tensor, node_logits: torch.Tensor, tree: CandidateTree,
                max_accepted: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a trie of candidates against the model's logits; everything stays on the device.

    x_logits: (V,) after the input token x; node_logits: (n, V) after each trie node. Each candidate token is
    judged by its node's logits, penalized (when penalties are set) with its own history: the committed text and
    the candidate up to that token, as plain decoding would have it had it emitted them. max_accepted caps the
    accepted tokens (the published reference's N - 1; None: no cap). Returns (winner, n_accepted, matches (g,),
    chain (K + 1,)): the step emits chain[:n_accepted + 1].
    """
    device = x_logits.device
    first_logits = sampler.penalize(x_logits)
    first_choice = largest(first_logits)
    if tree.n_paths == 0:
        zero = first_choice.new_zeros(())
        token = first_choice if sampler.greedy else sampler.draw(sampler.probs(first_logits))
        return zero, zero, first_choice.new_zeros(0), token.view(1)
    node_of, lengths = tree.node_of.to(device), tree.lengths.to(device)
    candidates = tree.tokens[tree.node_of].to(device)  # (g, K), past a candidate's end: its last token again
    if sampler.penalizes or not sampler.greedy:  # each candidate's token judged with its own history, or sampled
        cand_logits = sampler.penalize(node_logits[node_of], candidates)  # (g, K, V)
        choices = largest(cand_logits)
    else:  # a node's choice is the same in every candidate through it: one per node
        choices = largest(node_logits)[node_of]
    best, n_accepted, chain, matches = greedy_verify(first_choice, candidates, choices, lengths)
    if not sampler.greedy:
        best, n_accepted, chain = sample_verify(sampler.probs(first_logits), candidates, cand_logits, sampler,
                                                lengths=lengths)
    if max_accepted is not None:
        n_accepted = n_accepted.clamp(max=max_accepted)
    return best, n_accepted, matches, chain


def greedy_verify(first: torch.Tensor, candidates: torch.Tensor, choices: torch.Tensor,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification: the longest candidate prefix that matches the model's own argmax chain.

    first: () the argmax after x. choices: (g, K) the argmax after each candidate token (given the candidate's
    earlier tokens). Returns (best, n_accepted, emitted): the winning candidate, how many of its tokens are
    accepted (0..its length), and the model's chain (K + 1,) along it, whose first n_accepted + 1 tokens are
    emitted: the accepted tokens, then the model's next token (the bonus token when the whole candidate matched).
    Ties go to the earlier candidate. Also returns n_match (g,): each candidate's count of leading matches.
    """
    g, K = candidates.shape
    chain = torch.cat([first.expand(g, 1), choices], dim=1)  # (g, K + 1)
    same = candidates == chain[:, :-1]
    if lengths is not None:
        same &= torch.arange(K, device=candidates.device) < lengths[:, None]
    n_match = same.int().cumprod(dim=1).sum(dim=1)  # leading matches, (g,)
    best = n_match.argmax()
    return best, n_match[best], chain[best], n_match


def sample_verify(probs0: torch.Tensor, candidates: torch.Tensor, cand_logits: torch.Tensor, sampler: Sampler,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verification of deterministic drafts under sampling (Lookahead Decoding, Algorithm 4).

    probs0: (V,) the warped distribution after x. cand_logits: (g, K, V) the logits after each candidate token
    (penalized, when penalties are set, with that row's own history: the committed text and the candidate so far).
    At each position the distinct tokens of the candidates still alive are tried in candidate order: token t is
    accepted with probability p(t); on rejection its mass is removed and p renormalised before the next one.
    After an acceptance only candidates that share the token stay alive and p becomes the model's distribution
    after it; when every distinct token is rejected the step ends with a draw from the residual p. When a whole
    candidate is accepted, the bonus token is drawn from the model's distribution after it. A candidate takes
    part at position i only while i < its length; once the alive ones have all ended, the walk stops there and
    the bonus token is drawn (ragged candidates: a trie whose leaves lie at different depths).
    Each emitted token is thus distributed exactly as autoregressive sampling would draw it.

    Returns (best, n_accepted, emitted): a surviving candidate, the number of its tokens accepted (0..length) and
    emitted (K + 1,), whose first n_accepted + 1 entries are the tokens of this step.
    """
    g, K = candidates.shape
    device = candidates.device
    order = torch.arange(g, device=device)
    inside = torch.ones(g, K, dtype=torch.bool, device=device) if lengths is None else \
        torch.arange(K, device=device) < lengths[:, None]  # (g, K)
    alive = torch.ones(g, dtype=torch.bool, device=device)
    running = torch.ones((), dtype=torch.bool, device=device)  # every position so far accepted a token
    n_accepted = torch.zeros((), dtype=torch.long, device=device)
    best = torch.zeros((), dtype=torch.long, device=device)
    p = probs0
    uniforms = sampler.uniform(g * K, device).view(K, g)
    for i in range(K):
        tokens = candidates[:, i].clamp_min(0)  # padding (past a candidate's end) never tries, so any id will do
        present = alive & inside[:, i]
        # The first alive candidate carrying each distinct token is the one that tries it.
        earlier_same = (tokens[:, None] == tokens[None, :]) & present[None, :] & (order[None, :] < order[:, None])
        tries = present & ~earlier_same.any(dim=1)
        p_try = torch.where(tries, p[tokens], 0.0)
        mass_before = p_try.cumsum(0) - p_try  # mass removed by the rejections before this try
        accept = tries & (uniforms[i] * (1.0 - mass_before).clamp_min(1e-30) < p_try)
        accepted = running & accept.any()
        winner = accept.int().argmax()  # first accepted try (meaningless unless `accepted`)
        # Where the walk stops here, p becomes the residual: the tried tokens' mass removed, renormalised.
        residual = p.index_fill(0, tokens[tries], 0.0)
        residual = residual / residual.sum().clamp_min(1e-30)
        p_next = sampler.probs(cand_logits[winner, i])
        p = torch.where(accepted, p_next, torch.where(running, residual, p))
        alive = present & (tokens == tokens[winner]) & accepted
        best = torch.where(accepted, winner, best)
        n_accepted = n_accepted + accepted.long()
        running = accepted
    last = sampler.draw(p)
    emitted = torch.cat([candidates[best], last.view(1)])
    emitted[n_accepted] = last
    return best, n_accepted, emitted
