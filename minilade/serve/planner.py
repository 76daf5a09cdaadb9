"""One planner for the whole pass: each greedy `auto` generation sizes its drafts for every row of the pass.

Alone, auto feeds a draft row when the tokens it is expected to add pay for what it adds to the step's cost. In a
shared pass the step's cost is that of all its rows, and every generation in it waits for them; so a generation
plans against the pass (decoding/auto.py: best_plan's costs, other_tokens and all_plain): it feeds the drafts that
raise the whole pass's expected tokens per second,

    (tokens of the others + 1 + chances fed) / cost of the pass (what the others feed, 1 + nodes fed),

above both its plain step beside what the others feed and the pass with every generation plain (all_plain: where
one-row calls share a pass far more cheaply than wider ones, generations that draft together may each find
drafting best only because the others draft), down to none (plain batched decoding) when rows stop paying. What a
pass costs depends on how it runs: where every row goes through the layers together (eager, batched.py), it is one
step's cost of all their rows (`rows_together`), and likewise where they are native (native_pass.py: one native
pass of every call, prompt parts included); where the model's steps are compiled (compiled_pass.py), one-row
calls share the pool's pass, wider calls go in groups, each pass as measured when the engine starts
(compiled_pass.SharedPasses.pass_cost), and parts of prompts run in an eager pass of their own. What the others
feed is what they fed or planned last: an auto generation tells its plan before each step (rows, expected tokens);
for any other call (a plain step, a lookahead step, a prefill chunk) the engine records its rows, each counted as
one token of work. The plans settle together as each generation answers the others' latest.

Only greedy generations plan for the pass: their answers do not depend on their plans. A sampled generation's
draws do (verification draws more or fewer numbers), so it plans as it would alone, to keep its seeded answer.
"""

from __future__ import annotations

import threading
from typing import Callable

# pass_cost(rows of the others' decoding calls, rows of their calls that run eagerly (prompt parts), one
# generation's step costs) -> the pass's seconds as a function of the rows this generation feeds (called for every
# plan a step weighs: the others' part is summed once)
PassCost = Callable[[list[int], list[int], Callable[[int], float]], Callable[[int], float]]


class PassPlans:
    """What each running generation feeds to the engine's passes: rows, the tokens they are expected to emit, and
    whether they run eagerly whatever the model's steps (a part of a prompt's prefill)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fed: dict[object, tuple[int, float, bool]] = {}

    def record(self, member: object, rows: int, tokens: float, eager: bool = False) -> None:
        with self._lock:
            self._fed[member] = (rows, tokens, eager)

    def leave(self, member: object) -> None:
        with self._lock:
            self._fed.pop(member, None)

    def generations(self, member: object) -> int:
        """How many generations feed the passes, `member` included."""
        with self._lock:
            return len(self._fed) + (member not in self._fed)

    def others(self, member: object) -> tuple[list[int], list[int], float]:
        """The rows of each generation but `member` (decoding calls, then eager ones), and the tokens they are
        expected to emit in all."""
        with self._lock:
            fed = [value for key, value in self._fed.items() if key is not member]
        return ([rows for rows, _, eager in fed if not eager], [rows for rows, _, eager in fed if eager],
                sum(tokens for _, tokens, _ in fed))


def rows_together(other_rows: list[int], eager_rows: list[int], costs: Callable[[int], float]
                  ) -> Callable[[int], float]:
    """PassCost of a pass in which every row goes through the layers together: one step of all the rows."""
    others = sum(other_rows) + sum(eager_rows)
    return lambda rows: costs(others + rows)


class PassMember:
    """One generation's part in the shared passes (auto's SharedPasses). Until the generation plans its own steps
    (its prefill, or a strategy that does not plan), the engine records each of its calls (PassPlans.record)."""

    def __init__(self, plans: PassPlans, pass_cost: PassCost = rows_together) -> None:
        self.plans, self.pass_cost, self.planning = plans, pass_cost, False

    def others(self, costs: Callable[[int], float]) -> tuple[Callable[[int], float], float, float]:
        """auto.SharedPasses.others: the pass's seconds by this generation's rows, the others' tokens, and the pass's
        tokens per second were every decoding generation to feed one row (a prompt's part counts its rows as
        tokens of work, as in the others' tokens)."""
        other_rows, eager_rows, tokens = self.plans.others(self)
        plain_pass = self.pass_cost([1] * len(other_rows), eager_rows, costs)(1)
        return (self.pass_cost(other_rows, eager_rows, costs), tokens,
                (len(other_rows) + 1 + sum(eager_rows)) / plain_pass)

    def generations(self) -> int:
        """auto.SharedPasses.generations: the generations feeding the passes, this one included."""
        return self.plans.generations(self)

    def plan(self, rows: int, expected: float) -> None:
        self.planning = True
        self.plans.record(self, rows, expected)

    def fed(self, rows: int, eager: bool = False) -> None:
        """The engine ran a call of `rows` rows for this generation (eagerly: a part of its prompt's prefill)."""
        if not self.planning:
            self.plans.record(self, rows, rows, eager)

    def leave(self) -> None:
        self.plans.leave(self)
