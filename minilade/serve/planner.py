"""One planner for the whole pass: each greedy `auto` generation sizes its drafts for every row of the pass.

Alone, auto feeds a draft row when the tokens it is expected to add pay for what it adds to the step's cost. In a
shared pass the step's cost is that of all its rows, and every generation in it waits for them; so a generation
plans against the pass (decoding/auto.py: best_plan's `others`): it feeds the drafts that raise the whole pass's
expected tokens per second,

    (tokens of the others + 1 + chances fed) / cost(rows of the others + 1 + nodes fed),

down to none (plain batched decoding) when rows stop paying. What the others feed is what they fed or planned
last: an auto generation tells its plan before each step (rows, expected tokens); for any other call (a plain step,
a lookahead step, a prefill chunk) the engine records its rows, each counted as one token of work. The plans
settle together as each generation answers the others' latest.

Only greedy generations plan for the pass: their answers do not depend on their plans. A sampled generation's
draws do (verification draws more or fewer numbers), so it plans as it would alone, to keep its seeded answer.
"""

from __future__ import annotations

import threading


class PassPlans:
    """What each running generation feeds to the engine's passes: rows, and the tokens they are expected to emit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fed: dict[object, tuple[int, float]] = {}

    def record(self, member: object, rows: int, tokens: float) -> None:
        with self._lock:
            self._fed[member] = (rows, tokens)

    def leave(self, member: object) -> None:
        with self._lock:
            self._fed.pop(member, None)

    def others(self, member: object) -> tuple[int, float]:
        """(rows, expected tokens) fed by every generation but `member`."""
        with self._lock:
            fed = [value for key, value in self._fed.items() if key is not member]
        return sum(rows for rows, _ in fed), sum(tokens for _, tokens in fed)


class PassMember:
    """One generation's part in the shared passes (auto's SharedPasses). Until the generation plans its own steps
    (its prefill, or a strategy that does not plan), the engine records each of its calls (PassPlans.record)."""

    def __init__(self, plans: PassPlans) -> None:
        self.plans, self.planning = plans, False

    def others(self) -> tuple[int, float]:
        return self.plans.others(self)

    def plan(self, rows: int, expected: float) -> None:
        self.planning = True
        self.plans.record(self, rows, expected)

    def fed(self, rows: int) -> None:
        """The engine ran a call of `rows` rows for this generation."""
        if not self.planning:
            self.plans.record(self, rows, rows)

    def leave(self) -> None:
        self.plans.leave(self)
