"""minilade/tokenizer/detokenize.py: decode() against transformers and `sentencepiece` on random ids (invalid
UTF-8 included), and StreamDecoder against decode() on random and adversarial id sequences."""

from __future__ import annotations

import random
import re

from minilade.tokenizer import StreamDecoder, Tokenizer

from .conftest import assert_one_line_error, byte_level_chars, spm_texts

# ---------------------------------------------------------------------------------------------------------------
# decode()
# ---------------------------------------------------------------------------------------------------------------

def test_smollm2_decode_random_ids_matches_transformers(smollm2: Tokenizer, hf_smollm2) -> None:
    """Random ids spell plenty of invalid UTF-8 and hit the control tokens (ids 0-16)."""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(17), rng.randrange(smollm2.vocab_size)]) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            assert smollm2.decode(ids, skip_special=skip) == hf_smollm2.decode(ids, skip_special_tokens=skip), ids


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


def test_decode_outside_the_vocabulary_is_a_one_line_error(spm) -> None:
    _, gguf_path, _ = spm
    tokenizer = Tokenizer.from_checkpoint(gguf_path)
    assert_one_line_error(lambda: tokenizer.decode([tokenizer.vocab_size]), "outside the vocabulary")


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
    byte_ids = [hf_smollm2.convert_tokens_to_ids(char) for char in byte_level_chars()]
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
    texts = spm_texts()
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
