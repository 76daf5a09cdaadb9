"""Decoding strategies and the one generation loop that runs them.

    base.py            Strategy (user settings) -> Decoder (one generation's state) -> Step (what a step did)
    loop.py            decode_tokens: prefill, steps, budget, EOS, statistics; written once for every strategy
    autoregressive.py  one token per forward pass
    lookahead.py       Lookahead decoding: the Jacobi window, the n-gram pool and verification in one pass
    auto.py            lookahead with every step shaped from measured step costs and running acceptance
    step_costs.py      what a forward pass of T tokens costs on this machine
"""

from .auto import Auto
from .autoregressive import Autoregressive
from .base import DecodeContext, Decoder, Strategy
from .lookahead import Lookahead
from .loop import GenerationStats, TokenRun, decode_tokens

__all__ = ["Auto", "Autoregressive", "DecodeContext", "Decoder", "GenerationStats", "Lookahead", "Strategy",
           "TokenRun", "decode_tokens"]
