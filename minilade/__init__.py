"""minilade: a pure-PyTorch LLaMA inference engine built around Lookahead Decoding."""

from .auto import Auto
from .engine import GenerationStats
from .llm import LLM, Generation
from .lookahead import Lookahead
from .sampling import SamplingParams
from .strategies import Autoregressive, Strategy

__all__ = ["Auto", "LLM", "Generation", "GenerationStats", "Lookahead", "Autoregressive", "Strategy", "SamplingParams"]
