"""Small shared builders for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from minilade.config import ModelConfig
from minilade.decoding.base import Strategy
from minilade.decoding.loop import GenerationStats, TokenRun, decode_tokens
from minilade.model import Transformer
from minilade.sampling import SamplingParams


def tiny_model(vocab: int = 16, seed: int = 0, std: float = 0.3, preset: str = "tiny-gqa",
               dtype: torch.dtype = torch.float32) -> Transformer:
    """A random tiny model. A small vocabulary and large weights make its greedy output repetitive,
    so lookahead finds n-grams to verify."""
    config = ModelConfig.preset(preset).replace(vocab_size=vocab)
    return Transformer(config).init_random(seed=seed, std=std).to(dtype).eval()


def run_tokens(model: Transformer, prompt: Sequence[int], strategy: Strategy, *, max_new_tokens: int = 40,
               sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = ()) -> tuple[list[int], TokenRun]:
    run = TokenRun(GenerationStats())
    tokens = list(decode_tokens(model, prompt, run, strategy=strategy, sampling=sampling,
                                max_new_tokens=max_new_tokens, eos_ids=eos_ids))
    return tokens, run


def write_tiny_checkpoint(folder: Path, words: str, max_positions: int, chat_template: str | None = None) -> Path:
    """A random tiny LLaMA folder as transformers writes it, with a byte-level BPE tokenizer trained on `words`
    (and chat_template.jinja when given): a real checkpoint for CLI and script tests that needs no download."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([words] * 10, trainer)
    tok.save(str(folder / "tokenizer.json"))
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, eos_token_id=2, bos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder
