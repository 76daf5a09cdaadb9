"""Text <-> token ids for LLaMA-family checkpoints, with chat templates and streaming detokenisation.

One behaviour, three sources. Where each idea lives:
  core.py           Tokenizer: encode, decode, chat prompts; `Tokenizer.from_checkpoint` picks the source
  hf.py             source: a Hugging Face folder (tokenizer.json, else SentencePiece tokenizer.model; side files)
  gguf.py           source: a GGUF file (the tokenizer rebuilt from the vocabulary in its metadata)
  parts.py          what a source hands to Tokenizer (TokenizerParts)
  detokenize.py     token id -> bytes tables, the decoding rule (U+FFFD handling), StreamDecoder
  chat_template.py  the sandboxed Jinja chat template
"""

from .core import Tokenizer
from .detokenize import StreamDecoder

__all__ = ["StreamDecoder", "Tokenizer"]
