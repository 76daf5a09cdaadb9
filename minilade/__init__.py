"""minilade: a pure-PyTorch LLaMA inference engine built around Lookahead Decoding."""

from .decoding import Auto, Autoregressive, GenerationStats, Lookahead, Strategy
from .drafts.history import DraftHistory
from .llm import LLM, Generation
from .sampling import SamplingParams

__all__ = ["Auto", "DraftHistory", "LLM", "Generation", "GenerationStats", "Lookahead", "Autoregressive", "Strategy",
           "SamplingParams"]
