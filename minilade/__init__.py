"""minilade: a pure-PyTorch LLaMA inference engine built around Lookahead Decoding."""
