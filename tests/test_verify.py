"""Verification on fixed model choices and stub distributions: greedy, and lossless sampling."""

from __future__ import annotations

import pytest
import torch

from minilade.masks import CandidateTree, LookaheadLayout, StepShape
from minilade.sampling import Sampler, SamplingParams
from minilade.verify import greedy_walk, sample_verify, verify_tree


def greedy(first: int, candidates: list[list[int]], choices: list[list[int]]) -> tuple[int, int, list[int]]:
    best, n, chain, _ = greedy_walk(first, choices, candidates)
    return best, n, chain[:n + 1]


def test_greedy_verify_full_match_keeps_bonus_token() -> None:
    # The model says 5 after x, 6 after 5, 7 after 6: candidate [5, 6] fully matches, 7 is the bonus token.
    assert greedy(5, [[5, 6]], [[6, 7]]) == (0, 2, [5, 6, 7])


def test_greedy_verify_partial_and_longest_match() -> None:
    candidates = [[5, 9, 9], [5, 6, 9], [4, 6, 7]]
    choices = [[6, 1, 1], [6, 7, 8], [6, 7, 8]]
    assert greedy(5, candidates, choices) == (1, 2, [5, 6, 7])


def test_greedy_verify_no_match_emits_models_token() -> None:
    assert greedy(3, [[5, 6], [4, 4]], [[6, 7], [4, 4]]) == (0, 0, [3])


def test_greedy_verify_tie_goes_to_earlier_candidate() -> None:
    assert greedy(5, [[5, 1], [5, 2]], [[3, 3], [3, 3]])[:2] == (0, 1)


# ---- the sampling verifier with stub distributions ---------------------------------------------------------

class ScriptedSampler(Sampler):
    """Plays back given uniforms and records the distribution of every draw (which returns its argmax)."""

    def __init__(self, uniforms: list[float]) -> None:
        super().__init__(SamplingParams(temperature=1.0, seed=0))
        self.uniforms = torch.tensor(uniforms)
        self.draws: list[torch.Tensor] = []

    def uniform(self, n: int, device) -> torch.Tensor:
        assert n == self.uniforms.numel()
        return self.uniforms.clone()

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        self.draws.append(probs.clone())
        return probs.argmax(-1)


V = 6
P0 = torch.tensor([0.05, 0.3, 0.35, 0.1, 0.15, 0.05])  # the model's distribution after x


def after(*probs: float) -> torch.Tensor:
    """Logits whose softmax is the given distribution (temperature 1 leaves it unchanged)."""
    return torch.log(torch.tensor(probs))


D1 = after(0.1, 0.1, 0.1, 0.4, 0.2, 0.1)  # after candidate token 1
D2 = after(0.3, 0.2, 0.1, 0.1, 0.2, 0.1)
D3 = after(0.2, 0.2, 0.2, 0.2, 0.1, 0.1)


def verify(candidates: list[list[int]], cand_logits: list[list[torch.Tensor]], uniforms: list[float]):
    sampler = ScriptedSampler(uniforms)  # uniforms are laid out (position, candidate)
    best, n, emitted = sample_verify(P0, torch.tensor(candidates), torch.stack([torch.stack(r) for r in cand_logits]),
                                     sampler)
    return int(best), int(n), emitted[:int(n) + 1].tolist(), sampler.draws


def test_one_candidate_accepted_with_probability_p() -> None:
    # p(1) = 0.3: u = 0.29 accepts token 1; the bonus token is drawn from the distribution after it.
    best, n, emitted, draws = verify([[1]], [[D1]], [0.29])
    assert (best, n) == (0, 1) and emitted == [1, 3]
    torch.testing.assert_close(draws[0], D1.softmax(-1))
    # u = 0.31 rejects it; the step emits a draw from p with token 1's mass removed.
    best, n, emitted, draws = verify([[1]], [[D1]], [0.31])
    assert n == 0 and emitted == [2]
    torch.testing.assert_close(draws[0], torch.tensor([0.05, 0, 0.35, 0.1, 0.15, 0.05]) / 0.7)


def test_second_candidate_tried_against_the_renormalised_residual() -> None:
    # Token 1 (p 0.3) rejected; token 2 is then accepted with probability 0.35 / 0.7 = 0.5.
    candidates, logits = [[1], [2]], [[D1], [D2]]
    assert verify(candidates, logits, [0.9, 0.49])[:3] == (1, 1, [2, 0])
    best, n, emitted, draws = verify(candidates, logits, [0.9, 0.51])
    assert n == 0
    torch.testing.assert_close(draws[0], torch.tensor([0.05, 0, 0, 0.1, 0.15, 0.05]) / 0.35)


def test_duplicate_tokens_are_tried_once() -> None:
    # Candidates 0 and 1 both start with token 1; a rejection of token 1 must not be retried by candidate 1,
    # whose uniform (0.0) would otherwise accept it.
    best, n, emitted, draws = verify([[1, 3], [1, 4], [2, 0]], [[D1, D3], [D1, D3], [D2, D3]],
                                     [0.9, 0.0, 0.9, 0.9, 0.9, 0.9])
    assert n == 0
    torch.testing.assert_close(draws[0], torch.tensor([0.05, 0, 0, 0.1, 0.15, 0.05]) / 0.35)


def test_shared_prefix_continues_with_the_accepted_branch() -> None:
    # Both candidates start with token 1 (accepted, u 0.1 < 0.3). Position 1 uses the distribution after
    # token 1: candidate 0's token 3 (p 0.4) is rejected (u 0.5), candidate 1's token 4 then has
    # probability 0.2 / 0.6: u 0.3 accepts it, and the bonus comes from candidate 1's last row.
    candidates, logits = [[1, 3], [1, 4]], [[D1, D2], [D1, D3]]
    best, n, emitted, draws = verify(candidates, logits, [0.1, 0.0, 0.5, 0.3])
    assert (best, n) == (1, 2) and emitted == [1, 4, 0]
    torch.testing.assert_close(draws[0], D3.softmax(-1))
    # With u 0.35 > 1/3 token 4 is rejected too: the residual after token 1 without 3 and 4.
    best, n, emitted, draws = verify(candidates, logits, [0.1, 0.0, 0.5, 0.35])
    assert n == 1 and emitted[0] == 1
    torch.testing.assert_close(draws[0], torch.tensor([0.1, 0.1, 0.1, 0, 0, 0.1]) / 0.4)


def test_greedy_verify_ragged_never_accepts_past_a_path_end() -> None:
    # Path 0 is [5] (padded with 6, which the model would also choose): it accepts 1 token, then the bonus 6.
    # Path 1 is [5, 6, 8]: the model chooses 7 after 6, so it accepts 2 and emits 7.
    best, n, chain, matches = greedy_walk(5, [[6, 7, 9], [6, 7, 9]], [[5], [5, 6, 8]])
    assert matches == [1, 2] and (best, n) == (1, 2) and chain[:3] == [5, 6, 7]
    best, n, chain, _ = greedy_walk(5, [[6, 7, 9]], [[5, 6]])
    assert n == 2 and chain[:3] == [5, 6, 7]  # a wholly matched short path keeps its bonus token


def verify_ragged(uniforms: list[float]):
    """Path [1] (length 1, padded with 3, D1's likeliest token) and path [2, 0]."""
    sampler = ScriptedSampler(uniforms)
    best, n, emitted = sample_verify(P0, torch.tensor([[1, 3], [2, 0]]),
                                     torch.stack([torch.stack([D1, D1]), torch.stack([D2, D3])]), sampler,
                                     lengths=torch.tensor([1, 2]))
    return int(best), int(n), emitted[:int(n) + 1].tolist(), sampler.draws


def test_sample_verify_ragged_stops_at_the_end_of_the_accepted_path() -> None:
    # Token 1 (p 0.3) accepted with u 0.1: its path ends, so the bonus is drawn from the distribution after 1, and
    # the padding is never tried.
    best, n, emitted, draws = verify_ragged([0.1, 0.0, 0.0, 0.0])
    assert (best, n) == (0, 1) and emitted == [1, 3]
    torch.testing.assert_close(draws[0], D1.softmax(-1))
    # Token 1 rejected (u 0.9), token 2 accepted (u 0.0), then the longer path's 0 is tried after 2.
    best, n, emitted, draws = verify_ragged([0.9, 0.0, 0.0, 0.0])
    assert (best, n) == (1, 2) and emitted[:2] == [2, 0]
    torch.testing.assert_close(draws[0], D3.softmax(-1))


# ---- the verifiers against their other forms ----------------------------------------------------------

def greedy_by_tensors(first: int, candidates: torch.Tensor, choices: torch.Tensor, lengths: torch.Tensor
                      ) -> tuple[int, int, list[int]]:
    """greedy_walk in tensor operations: each candidate's leading matches with the model's chain are the cumulative
    product of its matches; the first of the longest wins, and the step emits the chain along it."""
    g, K = candidates.shape
    chain = torch.cat([torch.full((g, 1), first), choices], dim=1)  # (g, K + 1)
    same = (candidates == chain[:, :-1]) & (torch.arange(K) < lengths[:, None])
    n_match = same.int().cumprod(dim=1).sum(dim=1)
    best = int(n_match.argmax())
    return best, int(n_match[best]), chain[best, :int(n_match[best]) + 1].tolist()


def sample_by_loops(probs0, candidates, cand_logits, sampler, lengths) -> tuple[int, int, list[int]]:
    """sample_verify as loops (Lookahead Decoding, Algorithm 4): at each position try the distinct tokens of the
    candidates still alive, in candidate order; accept token t with probability p(t) over the mass not yet
    rejected, else remove its mass; after an acceptance p is the model's distribution after it; when every
    token is rejected (or every alive candidate has ended) draw from what is left."""
    g, K = candidates.shape
    uniforms = sampler.uniform(g * K, "cpu").view(K, g)
    p, alive, best, n = probs0, [True] * g, 0, 0
    for i in range(K):
        tried, rejected_mass, winner = [], 0.0, None
        for j in range(g):
            token = int(candidates[j, i])
            if not alive[j] or i >= lengths[j] or token in tried:
                continue
            tried.append(token)
            if float(uniforms[i, j]) * max(1.0 - rejected_mass, 1e-30) < float(p[token]):
                winner = j
                break
            rejected_mass += float(p[token])
        if winner is None:
            residual = p.index_fill(0, torch.tensor(tried, dtype=torch.long), 0.0)
            p = residual / residual.sum().clamp_min(1e-30)
            break
        best, n = winner, n + 1
        alive = [alive[j] and i < lengths[j] and int(candidates[j, i]) == int(candidates[winner, i])
                 for j in range(g)]
        p = sampler.probs(cand_logits[winner, i])
    return best, n, candidates[best, :n].tolist() + [int(sampler.draw(p))]


def random_case(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates (g, K) over a small vocabulary, so that they share tokens, and their lengths (g,)."""
    g, K = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
    return torch.randint(vocab, (g, K), generator=gen), torch.randint(1, K + 1, (g,), generator=gen)


def test_greedy_walk_equals_its_tensor_form() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        candidates, lengths = random_case(gen, vocab=3)
        choices = torch.randint(3, candidates.shape, generator=gen)
        first = int(torch.randint(3, (1,), generator=gen))
        paths = [row[:n] for row, n in zip(candidates.tolist(), lengths.tolist())]
        best, n, chain, _ = greedy_walk(first, choices.tolist(), paths)
        assert (best, n, chain[:n + 1]) == greedy_by_tensors(first, candidates, choices, lengths)


@pytest.mark.parametrize("branch_free", [False, True], ids=["stopping", "branch-free"])
def test_sample_verify_equals_its_loop_form(branch_free: bool) -> None:
    """Both ways of walking the positions (stopping at the first rejection, on the CPU; every position without a
    read-back, on other devices) draw what the loops draw."""
    gen = torch.Generator().manual_seed(1)
    for case in range(300):
        candidates, lengths = random_case(gen, vocab=4)
        x_logits = torch.randn(V, generator=gen)
        cand_logits = torch.randn(*candidates.shape, V, generator=gen) * 2
        vectorised, loops = (Sampler(SamplingParams(temperature=1.0, seed=case)) for _ in range(2))
        best, n, emitted = sample_verify(vectorised.probs(x_logits), candidates, cand_logits, vectorised, lengths,
                                         branch_free)
        expected = sample_by_loops(loops.probs(x_logits), candidates, cand_logits, loops, lengths.tolist())
        assert (int(best), int(n), emitted[:int(n) + 1].tolist()) == expected


def test_a_sampled_verdict_teaches_the_calibration_what_the_draws_accepted() -> None:
    """Sampled, a candidate's matches are its leading tokens the draws accepted, not those the model's argmax would:
    x's likeliest token is 2, but the draws accept 1 (u 0.1 < p 0.3), reject 3 after it (u 0.5 >= 0.4) and accept 4
    against the residual (u 0.3 * 0.6 < 0.2)."""
    tree = CandidateTree.of([[1, 3], [1, 4], [2, 0]])
    after_node = {1: D1, 3: D2, 4: D3, 2: D2, 0: D3}
    logits = torch.stack([torch.log(P0)] + [after_node[t] for t in tree.tokens.tolist()])[None]
    shape = StepShape(LookaheadLayout(window=1, ngram=2, guesses=0), with_window=False, device=torch.device("cpu"))
    verdict, _ = verify_tree(ScriptedSampler([0.1, 0.0, 0.9, 0.5, 0.3, 0.9]), logits, shape, tree)
    assert (verdict.winner, verdict.n_accepted, verdict.emitted[:2]) == (1, 2, [1, 4])
    assert verdict.matches == [1, 2, 0]
    greedy, _ = verify_tree(Sampler(SamplingParams()), logits, shape, tree)
    assert greedy.matches == [0, 0, 2] and greedy.emitted[:2] == [2, 0]  # D2's likeliest token is 0
