"""What one generation did: tokens, forward passes, time, and the kinds of step taken."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

from .base import Step


@dataclass
class GenerationStats:
    """What one generation did. A step is one forward pass after the prefill."""

    strategy: str = ""
    prompt_tokens: int = 0
    kept_tokens: int = 0  # prompt tokens whose K/V were kept from an earlier generation, not read again
    new_tokens: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens_per_step: Counter = field(default_factory=Counter)  # tokens emitted by a step -> number of such steps
    step_kinds: Counter = field(default_factory=Counter)  # StepKind -> steps of that kind
    tokens_fed: int = 0  # tokens put through the model by the decoding steps (prefill excluded)
    drafts_fed: Counter = field(default_factory=Counter)  # source -> rows fed beyond x (Step.drafts_fed)
    drafts_accepted: Counter = field(default_factory=Counter)  # source -> tokens beyond one per step

    @property
    def forward_passes(self) -> int:
        return self.steps + 1

    @property
    def compression(self) -> float:
        """New tokens per forward pass, prefill included (1.0 for autoregressive decoding)."""
        return self.new_tokens / self.forward_passes

    @property
    def tokens_per_s(self) -> float:
        """End to end: new tokens over prefill plus decoding time."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total else 0.0

    @property
    def step_ms(self) -> float:
        return 1e3 * self.decode_s / self.steps if self.steps else 0.0

    @property
    def tokens_fed_per_step(self) -> float:
        return self.tokens_fed / self.steps if self.steps else 0.0

    def count(self, step: Step, seconds: float) -> None:
        """Add one decoding step (not the prefill)."""
        self.decode_s += seconds
        self.steps += 1
        self.tokens_per_step[len(step.tokens)] += 1
        self.step_kinds[step.kind] += 1
        self.tokens_fed += step.fed
        self.drafts_fed.update(step.drafts_fed)
        self.drafts_accepted.update(step.drafts_accepted)

    def summary(self) -> str:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.tokens_per_step.items()))
        kinds = ", ".join(f"{k} x{v}" for k, v in self.step_kinds.most_common()) if len(self.step_kinds) > 1 else ""
        kept = f" ({self.kept_tokens} kept)" if self.kept_tokens else ""
        return (f"[{self.strategy}] prompt {self.prompt_tokens} tok{kept}, new {self.new_tokens} tok in "
                f"{self.forward_passes} passes ({self.compression:.2f} tok/pass), "
                f"prefill {self.prefill_s * 1e3:.0f} ms, "
                f"decode {self.decode_s * 1e3:.0f} ms ({self.step_ms:.1f} ms/step), {self.tokens_per_s:.1f} tok/s"
                + (f", tokens/step histogram {hist}" if hist else "") + (f", steps: {kinds}" if kinds else ""))

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # asdict would turn StepKind keys into dicts
        d["tokens_per_step"] = {int(k): v for k, v in sorted(self.tokens_per_step.items())}
        d["step_kinds"] = {str(k): v for k, v in self.step_kinds.most_common()}
        d["drafts_fed"], d["drafts_accepted"] = dict(self.drafts_fed), dict(self.drafts_accepted)
        d.update(forward_passes=self.forward_passes, compression=self.compression, tokens_per_s=self.tokens_per_s,
                 step_ms=self.step_ms, tokens_fed_per_step=self.tokens_fed_per_step)
        return d
