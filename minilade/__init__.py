"""minilade: a pure-PyTorch LLaMA inference engine built around Lookahead Decoding."""

from .memory import collection_paused

with collection_paused():  # torch's import makes most of the objects a process keeps (memory.collection_paused)
    from .decoding import Auto, Autoregressive, GenerationStats, Lookahead, Strategy
    from .drafts.history import DraftHistory
    from .llm import LLM
    from .sampling import SamplingParams
    from .text_stream import Generation

__all__ = ["Auto", "DraftHistory", "LLM", "Generation", "GenerationStats", "Lookahead", "Autoregressive", "Strategy",
           "SamplingParams"]
