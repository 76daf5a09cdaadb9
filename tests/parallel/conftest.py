"""Tiny checkpoint folders as transformers writes them, shaped to split over 2 and 3 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Split evenly over 2 and 3 ranks (12 query, 6 key/value heads); the head is not tied to the embedding.
EVEN = dict(vocab_size=24, hidden_size=48, intermediate_size=96, num_attention_heads=12, num_key_value_heads=6,
            tie_word_embeddings=False)
# One key/value head (replicated on every rank), a tied head and a vocabulary that splits unevenly.
ONE_KV = dict(vocab_size=23, hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=1,
              tie_word_embeddings=True)


def write_checkpoint(folder: Path, shape: dict) -> Path:
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, max_position_embeddings=128, **shape)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: logits that differ token to token
        for p in model.parameters():
            p.mul_(8.0) if p.dim() == 2 else None
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def even_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("even"), EVEN)


@pytest.fixture(scope="session")
def one_kv_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("one_kv"), ONE_KV)
