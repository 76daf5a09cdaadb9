"""Decoding strategies and the one generation loop that runs them.

    base.py            Strategy (user settings) -> Decoder (one generation's state) -> Step (what one pass did)
    loop.py            GenerationSettings and decode_tokens: prefill, steps, budget, EOS
    stats.py           GenerationStats: what one generation did
    autoregressive.py  one token per forward pass
    lookahead.py       Lookahead decoding: the Jacobi window, the n-gram pool and verification in one pass
    auto.py            the paper's pieces and more draft sources, every step shaped from measured step costs
    step_costs.py      what a forward pass of T tokens costs on this machine
"""

from __future__ import annotations

from typing import Any

from .auto import Auto
from .autoregressive import Autoregressive
from .base import DecodeContext, Decoder, Step, Strategy
from .lookahead import Lookahead
from .loop import GenerationSettings, TokenRun, decode_tokens
from .stats import GenerationStats

STRATEGIES: dict[str, type[Strategy]] = {"autoregressive": Autoregressive, "lookahead": Lookahead, "auto": Auto}


def make_strategy(name: str, **settings: Any) -> Strategy:
    """A strategy by name ("autoregressive", "lookahead" or "auto") with the given settings (window, ngram,
    guesses, ...). Settings a strategy does not have are ignored, so one set of options serves every name."""
    try:
        kind = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose {', '.join(STRATEGIES)}") from None
    fields = getattr(kind, "__dataclass_fields__", {})
    return kind(**{k: v for k, v in settings.items() if k in fields})


__all__ = ["Auto", "Autoregressive", "DecodeContext", "Decoder", "GenerationSettings", "GenerationStats", "Lookahead",
           "STRATEGIES", "Step", "Strategy", "TokenRun", "decode_tokens", "make_strategy"]
