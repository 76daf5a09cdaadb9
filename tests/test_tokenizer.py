"""Tokenizer tests.

References: transformers' tokenizer built from the same GGUF (real SmolLM2 checkpoint), the `sentencepiece` library
(a tiny BPE model trained here, read from a folder and from a GGUF written the way llama.cpp writes one), and
tokenizer.json folders written by transformers. StreamDecoder is checked against decode() on random and
adversarial id sequences.
"""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece
import tokenizers
from tokenizers import pre_tokenizers

import minilade
from minilade.errors import TokenizerError
from minilade.tokenizer import StreamDecoder, Tokenizer

PACKAGE_DIR = Path(minilade.__file__).parent

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
# Fixtures
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_checkpoint(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf: Path):
    """transformers' own tokenizer for the same GGUF: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def _train_sentencepiece(folder: Path) -> sentencepiece.SentencePieceProcessor:
    """A tiny BPE model with byte fallback, normalised like Llama's (identity rule, spaces kept as they are)."""
    rng = random.Random(0)
    words = ("the quick brown fox jumps over the lazy dog tokenizer merges bytes fallback space prefix llama "
             "model piece score vocabulary hello world café naïve résumé Straße 2024 12345").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(3000)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=450, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        character_coverage=1.0, allow_whitespace_only_pieces=True, minloglevel=2,
    )
    folder.mkdir(parents=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


def _write_gguf(path: Path, vocab_size: int, **tokenizer: object) -> Path:
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


def _sentencepiece_token_type(processor: sentencepiece.SentencePieceProcessor, i: int) -> int:
    if processor.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if processor.is_control(i):
        return gguf.TokenType.CONTROL
    if processor.is_byte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, sentencepiece.SentencePieceProcessor]:
    """(folder with tokenizer.model, GGUF with the same vocabulary as llama.cpp writes it, the processor)."""
    root = tmp_path_factory.mktemp("spm")
    processor = _train_sentencepiece(root / "folder")
    n = processor.get_piece_size()
    (root / "gguf").mkdir()
    gguf_path = _write_gguf(
        root / "gguf" / "tiny.gguf", n,
        tokenizer_model="llama",
        token_list=[processor.id_to_piece(i) for i in range(n)],
        token_scores=[processor.get_score(i) for i in range(n)],
        token_types=[_sentencepiece_token_type(processor, i) for i in range(n)],
        bos_token_id=processor.bos_id(), eos_token_id=processor.eos_id(), unk_token_id=processor.unk_id(),
    )
    return root / "folder", gguf_path, processor


def _spm_texts() -> list[str]:
    rng = random.Random(1)
    words = "the quick brown fox llama tokenizer hello world café naïve 2024 12345 Straße".split()
    generated = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 10))) for _ in range(50)]
    return generated + [
        "  the  quick   brown  ", " leading", "trailing ", "   ", " ", "", "x",
        "tab\there\nnew line\r\n", "thethethe", "Straßenbahn", "naïveté",
        "日本語 😀 Ωmega ☃", "out-of-vocabulary: Ж ж ğ 🦙 \u0301",  # byte fallback
    ]


# ---------------------------------------------------------------------------------------------------------------
# Real SmolLM2 GGUF against transformers
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


def test_smollm2_decode_random_ids_matches_transformers(smollm2: Tokenizer, hf_smollm2) -> None:
    """Random ids spell plenty of invalid UTF-8 and hit the control tokens (ids 0-16)."""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(17), rng.randrange(smollm2.vocab_size)]) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            assert smollm2.decode(ids, skip_special=skip) == hf_smollm2.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_chat_matches_transformers(smollm2: Tokenizer, hf_smollm2, messages: list[dict[str, str]]) -> None:
    for prompt in (True, False):
        expected = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert smollm2.render_chat(messages, add_generation_prompt=prompt) == expected
    expected_ids = hf_smollm2.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert smollm2.encode_chat(messages) == expected_ids["input_ids"]


def test_tokenizer_json_folder_matches_transformers(hf_smollm2, tmp_path: Path) -> None:
    hf_smollm2.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0, 2]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    folder = Tokenizer.from_checkpoint(tmp_path)
    assert (folder.vocab_size, folder.bos_id, folder.eos_ids, folder.add_bos) == (49152, 1, (0, 2), False)
    for text in SMOLLM2_TEXTS:
        ids = folder.encode(text)
        assert ids == hf_smollm2.encode(text), text
        assert folder.decode(ids) == text
    for messages in CONVERSATIONS:
        assert folder.render_chat(messages) == hf_smollm2.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------------------------
# SentencePiece: a folder with tokenizer.model, the same vocabulary as a GGUF, and as a tokenizer.json
# ---------------------------------------------------------------------------------------------------------------

def test_sentencepiece_folder_matches_sentencepiece(spm) -> None:
    folder, _, processor = spm
    tokenizer = Tokenizer.from_checkpoint(folder)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_ids, tokenizer.add_bos) == (450, 1, (2,), True)
    for text in _spm_texts():
        ids = tokenizer.encode(text, add_bos=False)
        assert ids == processor.encode(text), text
        assert tokenizer.decode(ids) == processor.decode(ids) == text
    assert tokenizer.encode("hello") == [1, *processor.encode("hello")]


def test_sentencepiece_gguf_matches_sentencepiece(spm) -> None:
    """tokenizer.ggml.model='llama': BPE merges rebuilt from the scores, '▁' spaces and dummy prefix, byte
    fallback for characters outside the vocabulary."""
    _, gguf_path, processor = spm
    tokenizer = Tokenizer.from_checkpoint(gguf_path)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_ids, tokenizer.add_bos) == (450, 1, (2,), True)
    byte_fallbacks = 0
    for text in _spm_texts():
        ids = tokenizer.encode(text, add_bos=False)
        assert ids == processor.encode(text), text
        assert tokenizer.decode(ids) == processor.decode(ids) == text
        byte_fallbacks += sum(processor.is_byte(i) for i in ids)
    assert byte_fallbacks > 10  # the texts do exercise byte fallback


def _collapse_replacements(text: str) -> str:
    return re.sub("\ufffd+", "\ufffd", text)


def test_sentencepiece_decode_random_ids_matches_sentencepiece(spm) -> None:
    """Random ids (byte tokens included, so invalid UTF-8 too); SentencePiece drops control tokens when decoding.
    On invalid UTF-8 SentencePiece writes one U+FFFD per byte, we one per maximal invalid subsequence (as Python
    and Rust do): the same text once runs of U+FFFD are collapsed. And SentencePiece drops the leading '▁' of the
    first piece only, we (as HF's Strip decoder) a leading space even when a <0x20> byte token wrote it."""
    folder, gguf_path, processor = spm
    rng = random.Random(2)
    for tokenizer in (Tokenizer.from_checkpoint(folder), Tokenizer.from_checkpoint(gguf_path)):
        for _ in range(300):
            ids = [rng.randrange(1, tokenizer.vocab_size) for _ in range(rng.randint(1, 10))]  # 0 is <unk>
            ours, theirs = tokenizer.decode(ids, skip_special=True), processor.decode(ids)
            if theirs.startswith(" ") and ours == theirs[1:]:
                theirs = theirs[1:]
            assert _collapse_replacements(ours) == _collapse_replacements(theirs), ids
            if "\ufffd" not in theirs:
                assert ours == theirs, ids
        truncated = [processor.piece_to_id(f"<0x{b:02X}>") for b in "日".encode()[:2]]
        assert tokenizer.decode(truncated) == "\ufffd" and processor.decode(truncated) == "\ufffd\ufffd"


def test_sentencepiece_special_tokens_in_text(spm) -> None:
    """Control tokens written in the text are matched; each stretch of text between them gets its own dummy
    prefix (llama.cpp's behaviour), in the folder and the GGUF alike."""
    folder, gguf_path, processor = spm
    expected = [1, 1, *processor.encode("hello"), 2, *processor.encode(" x")]
    for path in (folder, gguf_path):
        assert Tokenizer.from_checkpoint(path).encode("<s>hello</s> x") == expected


def test_sentencepiece_tokenizer_json_folder(spm, tmp_path: Path) -> None:
    """A SentencePiece-style tokenizer.json (Metaspace pre-tokenizer, ByteFallback/Strip decoder), as transformers
    writes it from the same GGUF: same ids as transformers, SentencePiece-style decoding, BOS from the
    post-processor."""
    from transformers import AutoTokenizer

    _, gguf_path, processor = spm
    hf = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf.save_pretrained(tmp_path)
    tokenizer = Tokenizer.from_checkpoint(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_ids, tokenizer.add_bos) == (1, (2,), True)
    for text in _spm_texts():
        ids = tokenizer.encode(text)
        assert ids == hf.encode(text), text
        assert tokenizer.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)
        if not text.startswith(" "):  # Metaspace(prepend_scheme='first') adds no '▁' before a leading space
            assert ids[1:] == processor.encode(text)


# ---------------------------------------------------------------------------------------------------------------
# Byte-level GGUF pre-tokenizers on a tiny vocabulary
# ---------------------------------------------------------------------------------------------------------------

def _byte_level_chars() -> list[str]:
    """GPT-2's byte alphabet in byte order: printable Latin-1 bytes stand for themselves, the rest take U+0100 on."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    shifted = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def _byte_level_gguf(path: Path, pre: str, merges: list[str], extra: tuple[str, ...] = (), **fields: object) -> Path:
    """All 256 byte tokens, the merged tokens, extra tokens no merge makes, and one control token (BOS and EOS)."""
    tokens = _byte_level_chars() + [m.replace(" ", "") for m in merges] + list(extra) + ["<|begin_of_text|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    fields = {"bos_token_id": len(tokens) - 1, "eos_token_id": len(tokens) - 1, **fields}
    return _write_gguf(path, len(tokens), tokenizer_model="gpt2", tokenizer_pre=pre, token_list=tokens,
                       token_types=types, token_merges=merges, **fields)


def test_byte_level_pre_tokenizers(tmp_path: Path) -> None:
    """GPT-2 splits '12345' as one word, so the merge '3 4' applies; Llama 3 splits digits in threes ('123',
    '45') and takes a word that is a token whole, without merges (ignore_merges); SmolLM splits digits one by
    one. Llama 3 files also default to adding BOS."""
    merges = ["3 4", "1 2"]
    pieces = {}
    for pre in ("gpt-2", "llama-bpe", "smollm"):
        path = _byte_level_gguf(tmp_path / f"{pre}.gguf", pre, merges, extra=("123",))
        tokenizer = Tokenizer.from_checkpoint(path)
        ids = tokenizer.encode("12345<|begin_of_text|>", add_bos=False)
        pieces[pre] = ([tokenizer.decode([i]) for i in ids], tokenizer.add_bos)
    assert pieces["gpt-2"] == (["12", "34", "5", "<|begin_of_text|>"], False)
    assert pieces["llama-bpe"] == (["123", "4", "5", "<|begin_of_text|>"], True)
    assert pieces["smollm"] == (["1", "2", "3", "4", "5", "<|begin_of_text|>"], False)


def test_gguf_end_of_generation_ids_and_flags(tmp_path: Path) -> None:
    """eos, eot and eom ids all end generation; an explicit add_bos_token beats the pre-tokenizer's default."""
    path = _byte_level_gguf(tmp_path / "flags.gguf", "llama-bpe", ["1 2"], eot_token_id=7, eom_token_id=3,
                            add_bos_token=False, chat_template="{{ messages[0]['content'] }}!")
    tokenizer = Tokenizer.from_checkpoint(path)
    assert (tokenizer.eos_ids, tokenizer.bos_id, tokenizer.add_bos) == ((3, 7, 257), 257, False)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "hi!"


# ---------------------------------------------------------------------------------------------------------------
# StreamDecoder
# ---------------------------------------------------------------------------------------------------------------

def _assert_streams_like_decode(tokenizer: Tokenizer, ids: list[int], rng: random.Random, skip: bool) -> None:
    decoder = StreamDecoder(tokenizer, skip_special=skip)
    pieces, start = [], 0
    while start < len(ids):
        stop = start + rng.choice([1, 1, 1, 2, 3, 5])
        pieces.append(decoder.push(ids[start:stop]))
        start = stop
    pieces.append(decoder.finish())
    full = tokenizer.decode(ids, skip_special=skip)
    assert "".join(pieces) == full, ids
    if "\ufffd" not in full:
        assert not any("\ufffd" in piece for piece in pieces), (ids, pieces)


def _adversarial_smollm2_ids(tokenizer: Tokenizer, byte_ids: list[int], rng: random.Random) -> list[int]:
    """Real text, sometimes respelled one token per byte (multi-byte characters split across tokens), with
    special tokens and spaces at the boundaries."""
    text = rng.choice(["😀👍🏽 ok", " 日本語", "é\u0301 ñ", "👨\u200d👩\u200d👧", "  \n\t", "مرحبا", "x²", " a "])
    ids = tokenizer.encode(text) if rng.random() < 0.5 else [byte_ids[b] for b in text.encode("utf-8")]
    special = [rng.choice([0, 1, 2, 3])]
    return rng.choice([[], special]) + ids + rng.choice([[], special, ids])


def test_stream_decoder_smollm2(smollm2: Tokenizer, hf_smollm2) -> None:
    rng = random.Random(3)
    byte_ids = [hf_smollm2.convert_tokens_to_ids(char) for char in _byte_level_chars()]
    emoji = smollm2.encode("😀")  # several tokens for one character
    assert len(emoji) > 1 and StreamDecoder(smollm2).push(emoji[:1]) == ""
    for _ in range(300):
        random_ids = [rng.randrange(smollm2.vocab_size) for _ in range(rng.randint(1, 15))]
        for ids in (random_ids, _adversarial_smollm2_ids(smollm2, byte_ids, rng)):
            for skip in (False, True):
                _assert_streams_like_decode(smollm2, ids, rng, skip)


def test_stream_decoder_sentencepiece(spm) -> None:
    """Byte-fallback tokens and the leading '▁' that decode() drops (also after a skipped BOS)."""
    _, gguf_path, processor = spm
    tokenizer = Tokenizer.from_checkpoint(gguf_path)
    rng = random.Random(4)
    texts = _spm_texts()
    for _ in range(300):
        ids = tokenizer.encode(rng.choice(texts), add_bos=rng.random() < 0.5)
        if rng.random() < 0.3:
            ids += [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 6))]
        for skip in (False, True):
            _assert_streams_like_decode(tokenizer, ids, rng, skip)
    decoder = StreamDecoder(tokenizer, skip_special=True)
    assert decoder.push([1]) + decoder.push(processor.encode(" hi")) + decoder.finish() == " hi"


def test_stream_decoder_holds_back_only_unfinished_characters(smollm2: Tokenizer) -> None:
    decoder = StreamDecoder(smollm2)
    assert decoder.push(smollm2.encode("Hello")) == "Hello"  # complete text is not delayed
    cut = smollm2.encode("日")
    assert [decoder.push([i]) for i in cut][-1] == "日"
    assert decoder.push(cut[:1]) == "" and decoder.finish() == "\ufffd"  # a dangling lead byte, as decode() shows it


# ---------------------------------------------------------------------------------------------------------------
# Chat templates and errors
# ---------------------------------------------------------------------------------------------------------------

def test_chat_template_file_takes_precedence(spm, tmp_path: Path) -> None:
    folder, _, processor = spm
    (tmp_path / "tokenizer.model").write_bytes((folder / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "ignored"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% generation %}[{{ m.role }}] {{ m.content | tojson }}\n"
        "{% endgeneration %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tokenizer = Tokenizer.from_checkpoint(tmp_path)
    messages = [{"role": "user", "content": "a <b> & c"}]
    rendered = tokenizer.render_chat(messages)
    assert rendered == '<s>[user] "a <b> & c"\n[assistant]'
    # The template writes the BOS; encode_chat adds no second one although encode() adds one by default.
    assert tokenizer.encode_chat(messages) == tokenizer.encode(rendered, add_bos=False)
    assert tokenizer.encode_chat(messages).count(1) == 1 and tokenizer.encode("x") == [1, *processor.encode("x")]


def _assert_one_line_error(call, *fragments: str) -> None:
    with pytest.raises(TokenizerError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_errors_are_one_line(spm, tmp_path: Path) -> None:
    folder, gguf_path, _ = spm
    _assert_one_line_error(lambda: Tokenizer.from_checkpoint(tmp_path / "missing"), "no such file or folder")
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(lambda: Tokenizer.from_checkpoint(tmp_path / "empty"), "tokenizer.json", "tokenizer.model")
    (tmp_path / "notes.txt").write_text("hello")
    _assert_one_line_error(lambda: Tokenizer.from_checkpoint(tmp_path / "notes.txt"), "neither a folder nor a GGUF")
    bert = _write_gguf(tmp_path / "bert.gguf", 3, tokenizer_model="bert", token_list=["a", "b", "c"])
    _assert_one_line_error(lambda: Tokenizer.from_checkpoint(bert), "unsupported GGUF tokenizer model 'bert'")
    qwen = _byte_level_gguf(tmp_path / "qwen.gguf", "qwen2", ["1 2"])
    _assert_one_line_error(lambda: Tokenizer.from_checkpoint(qwen), "unsupported GGUF pre-tokenizer 'qwen2'")
    no_vocab = _write_gguf(tmp_path / "no_vocab.gguf", 3)
    _assert_one_line_error(lambda: Tokenizer.from_checkpoint(no_vocab), "no tokenizer vocabulary")

    chatless = Tokenizer.from_checkpoint(gguf_path)
    _assert_one_line_error(lambda: chatless.render_chat([{"role": "user", "content": "hi"}]), "no chat template")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.model").write_bytes((folder / "tokenizer.model").read_bytes())
    (tmp_path / "bad" / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message\nmust be from the user') }}{% endif %}"
        "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    )
    bad = Tokenizer.from_checkpoint(tmp_path / "bad")
    _assert_one_line_error(lambda: bad.render_chat([{"role": "system", "content": "x"}]), "must be from the user")
    _assert_one_line_error(lambda: bad.render_chat([{"role": "user", "content": "x"}]), "chat template failed")
    (tmp_path / "bad" / "chat_template.jinja").write_text("{% for m in messages %}")
    _assert_one_line_error(lambda: Tokenizer.from_checkpoint(tmp_path / "bad").render_chat([]), "does not compile")
    _assert_one_line_error(lambda: chatless.decode([chatless.vocab_size]), "outside the vocabulary")
