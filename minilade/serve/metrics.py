"""The server's counters, read by GET /metrics in Prometheus' text format.

Updated from the event loop (requests) and the engine thread (steps), hence one lock.
"""

from __future__ import annotations

import threading
from collections import Counter

from ..decoding import GenerationStats

# name -> (type, help); a counter's samples may carry labels.
METRICS = {
    "minilade_requests_total": ("counter", "Requests answered, by endpoint and HTTP status"),
    "minilade_requests_cancelled_total": ("counter", "Generations stopped before their end (client gone, shutdown)"),
    "minilade_requests_running": ("gauge", "Requests whose generation is running"),
    "minilade_queue_depth": ("gauge", "Requests waiting for a place in the engine"),
    "minilade_prompt_tokens_total": ("counter", "Prompt tokens of finished generations"),
    "minilade_prompt_tokens_cached_total": ("counter", "Prompt tokens whose K/V came from a kept cache"),
    "minilade_generated_tokens_total": ("counter", "Tokens generated"),
    "minilade_forward_passes_total": ("counter", "Forward passes the engine ran (each shared by its requests)"),
    "minilade_rows_fed_total": ("counter", "Rows (tokens) put through the model by the engine's passes"),
    "minilade_pass_requests_total": ("counter", "Requests served by the engine's passes, summed over passes"),
    "minilade_drafts_fed_total": ("counter", "Draft rows fed (rows beyond one per decoding step), by strategy and "
                                             "the source that proposed them (window: the lookahead window's rows)"),
    "minilade_drafts_accepted_total": ("counter", "Draft tokens accepted (tokens beyond one per step), by strategy "
                                                  "and source"),
}


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter = Counter()  # (name, labels) -> value
        self.gauges = {"minilade_requests_running": lambda: 0, "minilade_queue_depth": lambda: 0}

    def add(self, name: str, value: float = 1, **labels: str) -> None:
        with self._lock:
            self._values[name, tuple(sorted(labels.items()))] += value

    def forward_pass(self, requests: int, rows: int) -> None:
        self.add("minilade_forward_passes_total")
        self.add("minilade_pass_requests_total", requests)
        self.add("minilade_rows_fed_total", rows)

    def generation(self, stats: GenerationStats) -> None:
        """A finished generation's statistics (its steps were counted by forward_pass as they ran)."""
        self.add("minilade_prompt_tokens_total", stats.prompt_tokens)
        self.add("minilade_prompt_tokens_cached_total", stats.kept_tokens)
        self.add("minilade_generated_tokens_total", stats.new_tokens)
        for name, counts in (("minilade_drafts_fed_total", stats.drafts_fed),
                             ("minilade_drafts_accepted_total", stats.drafts_accepted)):
            for source, n in counts.items():
                self.add(name, n, strategy=stats.strategy, source=source)

    def render(self) -> str:
        """Every metric in Prometheus' text exposition format."""
        with self._lock:
            values = dict(self._values)
        lines = []
        for name, (kind, help) in METRICS.items():
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
            if name in self.gauges:
                lines.append(f"{name} {self.gauges[name]()}")
                continue
            samples = [(labels, v) for (n, labels), v in sorted(values.items()) if n == name] or [((), 0)]
            for labels, v in samples:
                text = ",".join(f'{k}="{v_}"' for k, v_ in labels)
                lines.append(f"{name}{{{text}}} {v:g}" if text else f"{name} {v:g}")
        return "\n".join(lines) + "\n"
