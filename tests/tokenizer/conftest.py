"""Fixtures and builders shared by the tokenizer tests.

References: transformers' tokenizer built from the same GGUF (real SmolLM2 checkpoint), the `sentencepiece` library
(a tiny BPE model trained here, read from a folder and from a GGUF written the way llama.cpp writes one), and
tokenizer.json folders written by transformers.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece

from minilade.errors import TokenizerError
from minilade.tokenizer import Tokenizer

SMOLLM2_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock somewhere; don't you think? WE'LL SEE.",
    "Tokenizers turn text into integers. They'd better be consistent: a model only ever sees the ids!",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # tab-indented\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}\n',
    "Pi is 3.14159265358979, e is 2.71828; 1,000,000 people in 2024. Call +1 (800) 123-4567.",
    "12345678901234567890 007 0.5e-10 0x1F 1_000",
    "   leading spaces", "trailing spaces   ", "a  b   c    d     e", "line one\n\nline three\r\nwindows\r\n",
    "\t\ttabs\t \t mixed \n \n", "\n", " ", "  ", "",
    "Café crème brûlée, naïve façade, Ångström, Straße, ĳ",
    "日本語のテキストと中文文本，한국어도 있습니다。",
    "Emoji: 😀👍🏽 👨\u200d👩\u200d👧\u200d👦 🇫🇷 ✨",
    "Combining: e\u0301 a\u0308 n\u0303 Z\u0324\u0354\u0367\u0311\u0313",
    "RTL: مرحبا بالعالم — שלום עולם",
    "Ελληνικά, русский текст, ภาษาไทย",
    "\u00a0non-breaking\u200bzero-width\ufeffbom",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x",
    "<|im_start|><|im_end|>",
    "near misses: <|im_start |> <im_start> <|im_end|",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Write a haiku about tokenizers."},
        {"role": "assistant", "content": "Bytes merge into words\nids flow like a stream\nnumbers, then meaning"},
        {"role": "user", "content": "Now one in 日本語 😀"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces \n\n and newlines  "}],
]


# ---------------------------------------------------------------------------------------------------------------
# The real SmolLM2 GGUF, ours and transformers'
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="package")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_checkpoint(smollm2_gguf)


@pytest.fixture(scope="package")
def hf_smollm2(smollm2_gguf: Path):
    """transformers' own tokenizer for the same GGUF: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


# ---------------------------------------------------------------------------------------------------------------
# A tiny SentencePiece vocabulary, as a tokenizer.model folder and as a GGUF
# ---------------------------------------------------------------------------------------------------------------

def _train_sentencepiece(folder: Path, user_defined: tuple[str, ...] = ()) -> sentencepiece.SentencePieceProcessor:
    """A tiny BPE model with byte fallback, normalised like Llama's (identity rule, spaces kept as they are), with
    `user_defined` pieces (added tokens, matched whole in text)."""
    rng = random.Random(0)
    words = ("the quick brown fox jumps over the lazy dog tokenizer merges bytes fallback space prefix llama "
             "model piece score vocabulary hello world café naïve résumé Straße 2024 12345").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(3000)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=450, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        character_coverage=1.0, allow_whitespace_only_pieces=True, minloglevel=2,
        **({"user_defined_symbols": list(user_defined)} if user_defined else {}),
    )
    folder.mkdir(parents=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


def write_gguf(path: Path, vocab_size: int, **tokenizer: object) -> Path:
    """A minimal valid llama GGUF: a few llama.* keys, one tiny tensor, and the given tokenizer.ggml.* fields."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    for name, value in tokenizer.items():
        getattr(writer, f"add_{name}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((vocab_size, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _sentencepiece_token_type(processor: sentencepiece.SentencePieceProcessor, i: int,
                              user_defined: tuple[str, ...] = ()) -> int:
    if processor.id_to_piece(i) in user_defined:
        return gguf.TokenType.USER_DEFINED
    if processor.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if processor.is_control(i):
        return gguf.TokenType.CONTROL
    if processor.is_byte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


# Added tokens of the `spm_added` vocabulary: a tag and a code fence, as chat and code models add them.
SPM_ADDED = ("<tool>", "```")


@pytest.fixture(scope="package")
def spm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, sentencepiece.SentencePieceProcessor]:
    """(folder with tokenizer.model, GGUF with the same vocabulary as llama.cpp writes it, the processor)."""
    return _spm_files(tmp_path_factory.mktemp("spm"), ())


@pytest.fixture(scope="package")
def spm_added(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, sentencepiece.SentencePieceProcessor]:
    """As `spm`, with the user-defined pieces SPM_ADDED."""
    return _spm_files(tmp_path_factory.mktemp("spm_added"), SPM_ADDED)


def _spm_files(root: Path, user_defined: tuple[str, ...]) -> tuple[Path, Path, sentencepiece.SentencePieceProcessor]:
    processor = _train_sentencepiece(root / "folder", user_defined)
    n = processor.get_piece_size()
    (root / "gguf").mkdir()
    gguf_path = write_gguf(
        root / "gguf" / "tiny.gguf", n,
        tokenizer_model="llama",
        token_list=[processor.id_to_piece(i) for i in range(n)],
        token_scores=[processor.get_score(i) for i in range(n)],
        token_types=[_sentencepiece_token_type(processor, i, user_defined) for i in range(n)],
        bos_token_id=processor.bos_id(), eos_token_id=processor.eos_id(), unk_token_id=processor.unk_id(),
    )
    return root / "folder", gguf_path, processor


def spm_texts() -> list[str]:
    rng = random.Random(1)
    words = "the quick brown fox llama tokenizer hello world café naïve 2024 12345 Straße".split()
    generated = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 10))) for _ in range(50)]
    return generated + [
        "  the  quick   brown  ", " leading", "trailing ", "   ", " ", "", "x",
        "tab\there\nnew line\r\n", "thethethe", "Straßenbahn", "naïveté",
        "日本語 😀 Ωmega ☃", "out-of-vocabulary: Ж ж ğ 🦙 \u0301",  # byte fallback
    ]


# ---------------------------------------------------------------------------------------------------------------
# Tiny byte-level GGUF vocabularies
# ---------------------------------------------------------------------------------------------------------------

def byte_level_chars() -> list[str]:
    """GPT-2's byte alphabet in byte order: printable Latin-1 bytes stand for themselves, the rest take U+0100 on."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    shifted = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def byte_level_gguf(path: Path, pre: str, merges: list[str], extra: tuple[str, ...] = (), **fields: object) -> Path:
    """All 256 byte tokens, the merged tokens, extra tokens no merge makes, and one control token (BOS and EOS)."""
    tokens = byte_level_chars() + [m.replace(" ", "") for m in merges] + list(extra) + ["<|begin_of_text|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    fields = {"bos_token_id": len(tokens) - 1, "eos_token_id": len(tokens) - 1, **fields}
    return write_gguf(path, len(tokens), tokenizer_model="gpt2", tokenizer_pre=pre, token_list=tokens,
                      token_types=types, token_merges=merges, **fields)


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------

def assert_one_line_error(call, *fragments: str) -> None:
    """call() raises a TokenizerError whose message is one line containing every fragment."""
    with pytest.raises(TokenizerError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message
