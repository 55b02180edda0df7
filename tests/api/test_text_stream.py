"""The incremental detokenizer: text deltas that never split a character or send part of a stop
string, equal to decoding the whole answer, at constant work per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.api.text_stream import TextStream
from tests.support.api_helpers import ByteTokenizer
from tests.support.tiny_models import build_tiny_tokenizer

CORPUS = (
    "The capital of France is Paris.  Two  spaces, a tab\tand\nnew lines\n\n"
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. "
    "Emoji: 🙂👍🏽🇫🇷 and a family 👨‍👩‍👧. Code: def f(x):\n    return x ** 2  # square\n"
    "Numbers 3.14159, 1,000,000 and 2026-12-07. Ünïcödé àccents, ελληνικά, русский, العربية."
)


def push_all(stream: TextStream, ids) -> list[str]:
    return [stream.push(i) for i in ids] + [stream.finish()]


class CountingDecode:
    """A decode function that records how many ids each call decoded."""

    def __init__(self, decode):
        self._decode = decode
        self.sizes: list[int] = []

    def __call__(self, ids) -> str:
        self.sizes.append(len(ids))
        return self._decode(ids)


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A SentencePiece-like BPE (spaces as U+2581, byte fallback), trained in code: its decoder drops
    the first piece's leading space, so a piece decodes differently alone and after another."""
    def built(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        return tok

    # Few merges over the 60 commonest characters; every other character (CJK, emoji) is spelled
    # with the <0xNN> byte pieces, which are ordinary vocabulary entries as in SentencePiece.
    trained = built({"<unk>": 0}, [])
    trainer = trainers.BpeTrainer(vocab_size=160, limit_alphabet=60, special_tokens=["<unk>"], show_progress=False)
    trained.train_from_iterator([CORPUS] * 4, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return built(vocab, [tuple(m) for m in model["merges"]])


def byte_level_tokenizer(tmp_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(build_tiny_tokenizer(tmp_path / "tok") / "tokenizer.json"))


@pytest.fixture(params=["byte-level BPE", "SentencePiece-style"])
def tokenizer(request, tmp_path) -> Tokenizer:
    if request.param == "byte-level BPE":
        return byte_level_tokenizer(tmp_path)
    return sentencepiece_style_tokenizer()


def test_deltas_add_up_to_the_whole_decode_on_real_tokenizers(tokenizer):
    ids = tokenizer.encode(CORPUS, add_special_tokens=False).ids
    assert len(ids) > 100  # not a token per word: characters are cut across byte tokens
    def decode(x):
        return tokenizer.decode(list(x), skip_special_tokens=True)
    stream = TextStream(decode)
    deltas = push_all(stream, ids)
    assert "".join(deltas) == decode(ids) == stream.text
    assert not any("\ufffd" in d for d in deltas)
    # offsets[i] is where token i's text starts: the characters the ids before it complete. Where
    # those ids decode cleanly that is their text's length. (Not elsewhere: a byte-fallback decoder
    # turns a complete character into U+FFFDs when a cut one follows it in the same byte run.)
    clean = {i: len(t) for i in range(len(ids)) if "\ufffd" not in (t := decode(ids[:i]))}
    assert len(clean) > len(ids) // 2
    assert all(stream.offsets[i] == n for i, n in clean.items())
    assert stream.offsets == sorted(stream.offsets) and stream.offsets[-1] <= len(stream.text)


def test_a_4000_token_answer_costs_constant_work_per_token(tmp_path):
    tokenizer = byte_level_tokenizer(tmp_path)
    ids = (tokenizer.encode(CORPUS, add_special_tokens=False).ids * 40)[:4000]
    assert len(ids) == 4000
    decode = CountingDecode(lambda x: tokenizer.decode(list(x)))
    stream = TextStream(decode, stop=("never appears in the text",))
    text = "".join(push_all(stream, ids))
    assert text == tokenizer.decode(ids)
    # Each token decodes a window of a few ids (a character cut across k tokens: k more), never the
    # answer so far: decoding it whole on every token would be 4000 * 4001 / 2 = 8,002,000 ids.
    assert max(decode.sizes) <= 16
    assert sum(decode.sizes) <= 8 * len(ids)


def test_bytes_that_never_make_a_character_do_not_grow_the_window():
    ids = [ord("a")] + [0x80] * 50 + [ord("b")]  # fifty lone continuation bytes
    decode = CountingDecode(ByteTokenizer().decode)
    stream = TextStream(decode)
    text = "".join(push_all(stream, ids))
    assert text == ByteTokenizer().decode(ids)
    assert max(decode.sizes) <= 16


def test_text_stream_never_splits_a_multibyte_character():
    text = "añb€c🙂d"
    deltas = push_all(TextStream(ByteTokenizer().decode), text.encode())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[text.encode().index("🙂".encode()) : text.encode().index(b"d")][-1] == "🙂"


def first_stop_cut(text: str, stops: tuple[str, ...]) -> str:
    """Text up to the stop string that completes first (generation halts the moment one appears)."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return text[: min(found)[1]] if found else text


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"),
               max_size=30),
       st.lists(st.text(min_size=1, max_size=4), max_size=3).map(tuple))
def test_text_stream_matches_cutting_the_whole_text(text, stops):
    stream = TextStream(ByteTokenizer().decode, stops)
    deltas = push_all(stream, text.encode())
    assert "".join(deltas) == first_stop_cut(text, stops) == stream.text
    assert not any("\ufffd" in d for d in deltas)


def test_text_stream_flushes_a_truncated_character_at_the_end():
    stream = TextStream(ByteTokenizer().decode)
    assert stream.push(ord("a")) == "a"
    assert stream.push("€".encode()[0]) == ""
    assert stream.finish() == "\ufffd"


def test_stop_string_is_cut_and_never_partly_sent():
    stream = TextStream(ByteTokenizer().decode, stop=("END", "wor"))
    deltas = [stream.push(b) for b in b"hello world END"]
    assert "".join(deltas) == "hello " and stream.stopped
    assert stream.finish() == "" and stream.text == "hello "


def test_a_held_stop_prefix_is_released_when_the_stop_string_does_not_follow():
    stream = TextStream(ByteTokenizer().decode, stop=("xyz",))
    assert [stream.push(b) for b in b"axy"] == ["a", "", ""]
    assert stream.push(ord("!")) == "xy!"
    assert not stream.stopped


def test_a_stop_string_found_across_a_cut_character_is_cut_before_it():
    stream = TextStream(ByteTokenizer().decode, stop=("€!",))
    text = "".join(push_all(stream, "ab€!cd".encode()))
    assert text == "ab" and stream.stopped
