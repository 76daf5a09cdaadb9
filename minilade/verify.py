"""Verification: which candidate tokens does the model itself produce, and what does it produce next?

The model's choices (argmax) and a sampled step's draws are made on the device and read back in one transfer;
which candidate wins and how far is then decided on the host, over a few dozen integers (greedy_walk).
Notation: candidates (g, K), all proposed to follow the input token x; candidate j is its first lengths[j] tokens
(1..K; None: all K), the rest of its row is padding that is never accepted. A path never accepts past its own end,
and a wholly accepted path is still followed by the model's next token (the bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .masks import CandidateTree, StepShape
from .sampling import Sampler, greedy_choices, largest


@dataclass(frozen=True)
class Verdict:
    """What verification decided in one step, on the host.

    emitted: the step's tokens (the accepted candidate tokens, then the model's next token). winner: the index of
    the accepted candidate (meaningful when n_accepted > 0). matches: per candidate, how many of its leading tokens
    were accepted, or would have been on its own: its common prefix with the tokens the step accepted (greedy: with
    the model's argmax chain along it). The draft calibration learns from them: token i of a candidate had its
    parent accepted when i <= matches, and was accepted itself when i < matches.
    """

    emitted: list[int]
    winner: int
    n_accepted: int
    matches: list[int]


def verify_tree(sampler: Sampler, logits: torch.Tensor, shape: StepShape, tree: CandidateTree,
                max_accepted: int | None = None) -> tuple[Verdict, list[int]]:
    """Verify a trie of candidates against a packed step's logits (1, R, V) as its forward returned them, the rows
    shape.read lists: x's, the newest window level's, then every trie node's. Returns the verdict and the window's
    new level (the argmax at its rows: greedy even when sampling, as the window only proposes).

    The model's choices (and a sampled step's draws) are made on the device, greedy ones by the forward itself where
    it makes them beside its logits (sampling.with_choices), and read back in one transfer, the step's one host
    synchronisation; the walk along the candidates runs on the host (greedy_walk), over a few dozen integers.
    max_accepted caps the accepted tokens (the published reference's N - 1; None: no cap)."""
    paths = tree.paths()
    if sampler.greedy and not sampler.penalizes:  # a node's choice is the same in every candidate through it
        row_choices = read_back(greedy_choices(logits)[0])[0]  # every row's, made by the forward or now
        level, after = row_choices[shape.level_logits], row_choices[shape.node_logits_from:]
        greedy, drawn = (row_choices[0], [[after[node] for node in nodes] for nodes in tree.node_of.tolist()]), None
    else:
        level, greedy, drawn = judged_per_candidate(sampler, logits[0], shape, tree)
    if drawn is None:
        winner, n_accepted, chain, matches = greedy_walk(*greedy, paths)
    else:  # sampled: the draws decide, and what they accepted is what the calibration learns
        winner, n_accepted, chain = drawn
        matches = [common_prefix(path, chain[:n_accepted]) for path in paths]
    if max_accepted is not None:
        n_accepted = min(n_accepted, max_accepted)
    return Verdict(chain[:n_accepted + 1], winner, n_accepted, matches), level


def judged_per_candidate(sampler: Sampler, logits: torch.Tensor, shape: StepShape, tree: CandidateTree
                         ) -> tuple[list[int], tuple[int, list[list[int]]] | None, tuple[int, int, list[int]] | None]:
    """verify_tree with penalties or sampling: each candidate token judged by its node's logits penalized with its
    own history (the committed text and the candidate up to that token, as plain decoding would have it had it
    emitted them). Greedy, by the choices there; sampling, by sample_verify's draws. Returns (the window level's
    choices, greedy: (the model's choice after x, each candidate's choices (g, K)) else None, sampling: the draws'
    (winner, n_accepted, chain) else None), read back in one transfer."""
    device = logits.device
    x_logits = sampler.penalize(logits[0])
    g, K = tree.node_of.shape
    tensors = [largest(logits[shape.level_logits])]
    if g:
        candidates = tree.tokens[tree.node_of].to(device)  # (g, K), past a candidate's end: its last token again
        cand_logits = sampler.penalize(logits[shape.node_logits_from:][tree.node_of.to(device)], candidates)
    if sampler.greedy:
        tensors += [largest(x_logits).view(1)] + ([largest(cand_logits)] if g else [])
    elif g:
        best, n_accepted, chain = sample_verify(sampler.probs(x_logits), candidates, cand_logits, sampler,
                                                lengths=tree.lengths.to(device))
        tensors += [best.view(1), n_accepted.view(1), chain]
    else:
        tensors += [sampler.draw(sampler.probs(x_logits)).view(1)]
    level, *rest = read_back(*tensors)
    if sampler.greedy:
        flat = rest[1] if g else []
        return level, (rest[0][0], [flat[j * K:(j + 1) * K] for j in range(g)]), None
    return level, None, ((rest[0][0], rest[1][0], rest[2]) if g else (0, 0, rest[0]))


def greedy_walk(first: int, choices: list[list[int]], paths: list[list[int]]
                ) -> tuple[int, int, list[int], list[int]]:
    """Greedy verification, on the host: the longest candidate prefix that matches the model's own argmax chain.

    first: the argmax after x. paths: the candidates (each its own length). choices[j][i]: the argmax after
    candidate j's token i (given the candidate's earlier tokens; at least len(paths[j]) of them). Returns (winner,
    n_accepted, chain, matches): the winning candidate (the earliest of equals; 0 without candidates), how many of
    its tokens are accepted, the model's chain along it (first, then its choices after the accepted tokens), whose
    first n_accepted + 1 tokens are emitted (the accepted tokens, then the model's next token: the bonus token when
    the whole candidate matched), and each candidate's count of leading matches."""
    matches = []
    for path, after in zip(paths, choices):
        n, expected = 0, first
        while n < len(path) and path[n] == expected:
            expected = after[n]
            n += 1
        matches.append(n)
    winner = max(range(len(paths)), key=matches.__getitem__, default=0)
    n_accepted = matches[winner] if paths else 0
    return winner, n_accepted, [first] + (choices[winner][:n_accepted] if paths else []), matches


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def read_back(*tensors: torch.Tensor) -> list[list[int]]:
    """Integer tensors as host lists, in one transfer."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()])
        at += t.numel()
    return out


def sample_verify(probs0: torch.Tensor, candidates: torch.Tensor, cand_logits: torch.Tensor, sampler: Sampler,
                  lengths: torch.Tensor | None = None, branch_free: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    branch_free: whether the walk runs every position without reading anything back (None: off the CPU, where a
    read-back waits for the device). On the CPU it stops at the first rejection instead; after one, nothing changes.

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
    if branch_free is None:
        branch_free = device.type != "cpu"
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
        # Where the walk stops here, p becomes the residual: the tried tokens' mass removed, renormalised. Where it
        # goes on, the model's distribution after the accepted token; nothing changes once it stopped.
        if branch_free:
            p_next = sampler.probs(cand_logits[winner, i])
            p = torch.where(accepted, p_next, torch.where(running, residual(p, tokens[tries]), p))
        elif not bool(accepted):  # `running` held until here, or the loop would have ended
            p = residual(p, tokens[tries])
            break
        else:
            p = sampler.probs(cand_logits[winner, i])
        alive = present & (tokens == tokens[winner]) & accepted
        best = torch.where(accepted, winner, best)
        n_accepted = n_accepted + accepted.long()
        running = accepted
    last = sampler.draw(p)
    emitted = torch.cat([candidates[best], last.view(1)])
    emitted[n_accepted] = last
    return best, n_accepted, emitted


def residual(p: torch.Tensor, tried: torch.Tensor) -> torch.Tensor:
    """p (V,) with the tried tokens' mass removed, renormalised."""
    rest = p.index_fill(0, tried, 0.0)
    return rest / rest.sum().clamp_min(1e-30)
