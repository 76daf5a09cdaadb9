"""minilade/tokenizer/gguf.py: tokenizers rebuilt from GGUF metadata, against transformers (real SmolLM2 GGUF),
`sentencepiece` (a tiny model written as a GGUF the way llama.cpp writes one) and tiny byte-level vocabularies."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from tokenizers import pre_tokenizers

import minilade
from minilade.tokenizer import Tokenizer

from .conftest import (
    SMOLLM2_TEXTS,
    SPM_ADDED,
    assert_one_line_error,
    byte_level_gguf,
    spm_texts,
    write_gguf,
)

PACKAGE_DIR = Path(minilade.__file__).parent


# ---------------------------------------------------------------------------------------------------------------
# Real SmolLM2 GGUF ('gpt2' vocabulary, 'smollm' pre-tokenizer) against transformers
# ---------------------------------------------------------------------------------------------------------------

def test_smollm2_metadata(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert (smollm2.bos_id, smollm2.eos_ids, smollm2.add_bos) == (1, (2,), False)
    assert "<|im_start|>" in smollm2.chat_template


@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_encode_matches_transformers(smollm2: Tokenizer, hf_smollm2, text: str) -> None:
    assert smollm2.encode(text) == hf_smollm2.encode(text)


def test_smollm2_encodes_real_files_like_transformers(smollm2: Tokenizer, hf_smollm2) -> None:
    for path in (PACKAGE_DIR / "config.py", PACKAGE_DIR / "tokenizer" / "chat_template.py"):
        text = path.read_text(encoding="utf-8")
        assert smollm2.encode(text) == hf_smollm2.encode(text), path.name


def test_smollm2_splits_every_numeral(smollm2: Tokenizer, hf_smollm2) -> None:
    """'smollm' puts every \\p{N} character in a word of its own (SmolLM2's tokenizer.json: Digits(individual) then
    ByteLevel; llama.cpp: a '\\p{N}' split). transformers' GGUF loader ignores 'smollm' and uses plain GPT-2 splitting,
    which agrees on ASCII digits (the vocabulary has no multi-digit or 'Ġ1' tokens) but not on other numerals, so the
    reference here is transformers' vocabulary with the published pre-tokenizer."""
    reference = tokenizers.Tokenizer.from_str(hf_smollm2.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    for text in ["½ ² ³ ① Ⅻ ٣٤٥ १२३", "x² + y² = z²", "route 66 and ¼ mile", "Ⅷ. chapter"] + SMOLLM2_TEXTS:
        assert smollm2.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
    assert smollm2.encode(" ²") == [hf_smollm2.convert_tokens_to_ids("Ġ"), hf_smollm2.convert_tokens_to_ids("Â²")]


@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_decode_round_trips(smollm2: Tokenizer, hf_smollm2, text: str) -> None:
    ids = smollm2.encode(text)
    assert smollm2.decode(ids) == text == hf_smollm2.decode(ids)


# ---------------------------------------------------------------------------------------------------------------
# 'llama' vocabulary: SentencePiece BPE rebuilt from the scores
# ---------------------------------------------------------------------------------------------------------------

def test_sentencepiece_gguf_matches_sentencepiece(spm) -> None:
    """tokenizer.ggml.model='llama': BPE merges rebuilt from the scores, '▁' spaces and dummy prefix, byte
    fallback for characters outside the vocabulary."""
    _, gguf_path, processor = spm
    tokenizer = Tokenizer.from_checkpoint(gguf_path)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_ids, tokenizer.add_bos) == (450, 1, (2,), True)
    byte_fallbacks = 0
    for text in spm_texts():
        ids = tokenizer.encode(text, add_bos=False)
        assert ids == processor.encode(text), text
        assert tokenizer.decode(ids) == processor.decode(ids) == text
        byte_fallbacks += sum(processor.is_byte(i) for i in ids)
    assert byte_fallbacks > 10  # the texts do exercise byte fallback


def test_sentencepiece_gguf_with_added_tokens_matches_sentencepiece(spm_added) -> None:
    """User-defined pieces (Llama 2 fine-tunes add such tokens) are matched whole in text, as sentencepiece
    matches them, even inside words and next to spaces."""
    _, gguf_path, processor = spm_added
    tokenizer = Tokenizer.from_checkpoint(gguf_path)
    added = [processor.piece_to_id(piece) for piece in SPM_ADDED]
    seen = set()
    for text in spm_texts() + ["<tool>the fox</tool>", "```python\nhello```", "a<tool>b ``` c ````", "``` ```"]:
        ids = tokenizer.encode(text, add_bos=False)
        assert ids == processor.encode(text), text
        assert tokenizer.decode(ids) == processor.decode(ids) == text
        seen |= set(ids) & set(added)
    assert seen == set(added)
    # Control tokens written in text are cut out first; each stretch between them encodes as on its own (llama.cpp).
    bos, eos = processor.bos_id(), processor.eos_id()
    assert tokenizer.encode("<s>hello</s> the<tool>", add_bos=False) == [
        bos, *processor.encode("hello"), eos, *processor.encode(" the<tool>")]


# ---------------------------------------------------------------------------------------------------------------
# Byte-level vocabularies trained with `tokenizers` under each pre-tokenizer, written as llama.cpp writes them
# ---------------------------------------------------------------------------------------------------------------

# The split regexes of Llama 3's and Qwen2's tokenizer.json, written out here so the reference does not share
# minilade's copy.
REFERENCE_SPLITS = {
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+", True, False),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+", False, True),
}  # pre -> (regex, ignore_merges, NFC normaliser), as the models' tokenizer.json files set them
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>"]
CORPUS = SMOLLM2_TEXTS + [
    "The tokenizer merges bytes into words; numbers like 2024 and 1234567 split by the regex.",
    "def main():\n    for i in range(10):\n        print(i ** 2)\n\n\nif __name__ == '__main__':\n    main()\n",
]


def trained_byte_level(pre: str, specials: list[str] = SPECIALS) -> tokenizers.Tokenizer:
    """A byte-level BPE vocabulary of about 700 tokens trained under the pre-tokenizer `pre`, plus `specials`."""
    from tokenizers import Regex, decoders, models, normalizers, trainers

    regex, ignore_merges, nfc = REFERENCE_SPLITS[pre]
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_special_tokens(specials)
    return tok


def gguf_of(tok: tokenizers.Tokenizer, path: Path, pre: str, specials: list[str] = SPECIALS, **fields: object
            ) -> Path:
    """The vocabulary as llama.cpp's converter writes it: tokens by id, merges, CONTROL for special tokens (the
    first is BOS, the second EOS)."""
    import json

    import gguf

    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    return write_gguf(path, len(tokens), tokenizer_model="gpt2", tokenizer_pre=pre, token_list=tokens,
                      token_types=types, token_merges=merges, bos_token_id=vocab[specials[0]],
                      eos_token_id=vocab[specials[1]], **fields)


@pytest.mark.parametrize("pre", list(REFERENCE_SPLITS))
def test_trained_byte_level_vocabulary_matches_tokenizers(pre: str, tmp_path: Path) -> None:
    """Llama 3 ('llama-bpe') and Qwen2 ('qwen2') GGUF vocabularies encode and decode like the `tokenizers` model
    they were written from, on Unicode, code, whitespace runs, numerals and special tokens in text."""
    reference = trained_byte_level(pre)
    tokenizer = Tokenizer.from_checkpoint(gguf_of(reference, tmp_path / f"{pre}.gguf", pre))
    texts = SMOLLM2_TEXTS + ["<|begin_of_text|>Hi<|eot_id|>\n", "x<|eot_id|><|eot_id|>  ", "9876543210 + 42",
                             "\n\n\n    \t  \u3000end", "ﬁ Å e\u0301"]
    for text in texts:
        ids = tokenizer.encode(text, add_bos=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=False), text
    assert tokenizer.add_bos == (pre == "llama-bpe")  # llama.cpp's default for each


# Qwen2.5-Instruct's chat template without its tool-call branches: a default system prompt, ChatML turns.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_qwen2_gguf_chat_matches_transformers(tmp_path: Path) -> None:
    """A Qwen2 GGUF ('qwen2' vocabulary, ChatML template, <|im_end|> as EOS, no BOS) renders and encodes chats as
    transformers does with the same vocabulary and template."""
    from transformers import PreTrainedTokenizerFast

    from .conftest import CONVERSATIONS

    specials = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
    reference = trained_byte_level("qwen2", specials)
    path = gguf_of(reference, tmp_path / "qwen2.gguf", "qwen2", specials, chat_template=QWEN25_TEMPLATE,
                   add_bos_token=False)
    ours = Tokenizer.from_checkpoint(path)
    theirs = PreTrainedTokenizerFast(tokenizer_object=reference, chat_template=QWEN25_TEMPLATE)
    assert not ours.add_bos and ours.eos_ids == (reference.token_to_id("<|im_end|>"),)
    for messages in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(messages) == text
        assert ours.encode_chat(messages) == reference.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------------------------
# Byte-level pre-tokenizers and metadata flags on a tiny vocabulary
# ---------------------------------------------------------------------------------------------------------------

def test_byte_level_pre_tokenizers(tmp_path: Path) -> None:
    """GPT-2 splits '12345' as one word, so the merge '3 4' applies; Llama 3 splits digits in threes ('123',
    '45') and takes a word that is a token whole, without merges (ignore_merges); SmolLM splits digits one by
    one. Llama 3 files also default to adding BOS."""
    merges = ["3 4", "1 2"]
    pieces = {}
    for pre in ("gpt-2", "llama-bpe", "smollm"):
        path = byte_level_gguf(tmp_path / f"{pre}.gguf", pre, merges, extra=("123",))
        tokenizer = Tokenizer.from_checkpoint(path)
        ids = tokenizer.encode("12345<|begin_of_text|>", add_bos=False)
        pieces[pre] = ([tokenizer.decode([i]) for i in ids], tokenizer.add_bos)
    assert pieces["gpt-2"] == (["12", "34", "5", "<|begin_of_text|>"], False)
    assert pieces["llama-bpe"] == (["123", "4", "5", "<|begin_of_text|>"], True)
    assert pieces["smollm"] == (["1", "2", "3", "4", "5", "<|begin_of_text|>"], False)


def test_gguf_end_of_generation_ids_and_flags(tmp_path: Path) -> None:
    """eos, eot and eom ids all end generation; an explicit add_bos_token beats the pre-tokenizer's default."""
    path = byte_level_gguf(tmp_path / "flags.gguf", "llama-bpe", ["1 2"], eot_token_id=7, eom_token_id=3,
                           add_bos_token=False, chat_template="{{ messages[0]['content'] }}!")
    tokenizer = Tokenizer.from_checkpoint(path)
    assert (tokenizer.eos_ids, tokenizer.bos_id, tokenizer.add_bos) == ((3, 7, 257), 257, False)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "hi!"


def test_gguf_errors_are_one_line(tmp_path: Path) -> None:
    bert = write_gguf(tmp_path / "bert.gguf", 3, tokenizer_model="bert", token_list=["a", "b", "c"])
    assert_one_line_error(lambda: Tokenizer.from_checkpoint(bert), "unsupported GGUF tokenizer model 'bert'")
    tekken = byte_level_gguf(tmp_path / "tekken.gguf", "tekken", ["1 2"])
    assert_one_line_error(lambda: Tokenizer.from_checkpoint(tekken), "unsupported GGUF pre-tokenizer 'tekken'",
                          "llama-bpe", "qwen2")
    no_vocab = write_gguf(tmp_path / "no_vocab.gguf", 3)
    assert_one_line_error(lambda: Tokenizer.from_checkpoint(no_vocab), "no tokenizer vocabulary")


@pytest.mark.parametrize("fields, fragment", [
    ({"token_list": [1, 2, 3]}, "tokenizer.ggml.tokens is not a list of strings"),
    ({"token_list": ["a", "b", "c"], "token_types": [1.5, 1.0, 1.0]},
     "tokenizer.ggml.token_type is not a list of integers"),
    ({"token_list": ["a", "b", "c"], "token_scores": ["x", "y", "z"]},
     "tokenizer.ggml.scores is not a list of numbers"),
], ids=["tokens", "types", "scores"])
def test_gguf_vocabulary_of_the_wrong_type(tmp_path: Path, fields: dict[str, object], fragment: str) -> None:
    """Wrongly typed vocabulary arrays are one clear line, not a TypeError/ValueError traceback."""
    path = write_gguf(tmp_path / "typed.gguf", 3, tokenizer_model="gpt2", **fields)
    assert_one_line_error(lambda: Tokenizer.from_checkpoint(path), str(path), fragment)
