"""Every GGUF tokenizer kind we convert tokenizes as the tokenizer it came from.

Tiny vocabularies are trained in code (tests/export/tokenizer_ggufs.py), written into GGUFs as
llama.cpp's converter writes them, converted by export.gguf_tokenizer from the file, and compared
with their source on a multilingual corpus: ids, BOS, special and user-defined tokens, and
decode(encode(x)) == x. The slow test adds transformers' own GGUF loader as a second reference.
"""

from __future__ import annotations

import json
from itertools import combinations

import pytest
from tokenizers import Tokenizer

from engine.generation.tokenizer import BYTE_DECODER, ChatTokenizer
from export.gguf_pretokenizers import SPLITS
from export.gguf_tokenizer import GGUFTokenizerError, sentencepiece_merges, tokenizer_files, write_tokenizer_files
from tests.export.tokenizer_ggufs import (
    CORPUS,
    IGNORES_MERGES,
    LLAMA_CPP_REGEXES,
    SPECIALS,
    UNREACHABLE,
    USER_DEFINED,
    Vocabulary,
    byte_level_vocabulary,
    llama_cpp_split,
    sentencepiece_vocabulary,
    train_byte_level,
    train_sentencepiece,
    write_tokenizer_gguf,
)

BOS, EOS, START, END = range(4)  # SPECIALS' ids in every trained byte-level vocabulary
MIXED = f"{SPECIALS[START]}user\nHi  there {USER_DEFINED}x{SPECIALS[END]}\n 12 {USER_DEFINED}"


def _pre_tokenizer(name: str) -> Tokenizer:
    empty = {"type": "BPE", "vocab": {}, "merges": []}
    return Tokenizer.from_str(json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                                          "normalizer": None, "pre_tokenizer": SPLITS[name].pre_tokenizer(),
                                          "post_processor": None, "decoder": None, "model": empty}))


def _words(tok: Tokenizer, text: str) -> list[str]:
    """The text of each word the pre-tokenizer cuts (undoing the byte-level alphabet)."""
    return [bytes(BYTE_DECODER[c] for c in piece).decode("utf-8") for piece, _ in
            tok.pre_tokenizer.pre_tokenize_str(text)]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """pre-tokenizer name -> (source tokenizer, directory of our converted files)."""
    root = tmp_path_factory.mktemp("byte-level")
    out = {}
    for pre in LLAMA_CPP_REGEXES:
        source = train_byte_level(pre)
        gguf = write_tokenizer_gguf(root / f"{pre}.gguf", byte_level_vocabulary(source, pre), bos=BOS, eos=EOS,
                                    eot=END, add_bos=pre == "llama-bpe")
        write_tokenizer_files(gguf, root / pre)
        out[pre] = (source, root / pre)
    return out


@pytest.mark.parametrize("pre", list(LLAMA_CPP_REGEXES))
def test_a_byte_level_gguf_tokenizes_as_its_source(byte_level, pre):
    source, converted = byte_level[pre]
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    bos = [BOS] if pre == "llama-bpe" else []
    for text in [*CORPUS, MIXED]:
        want = source.encode(text).ids
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.encode(text).ids == bos + want, text
        assert ours.decode(ours.encode(text).ids) == text.replace(SPECIALS[START], "").replace(SPECIALS[END], "")
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == "".join(
            [SPECIALS[BOS]] if bos else []) + text
    assert ours.get_vocab_size() == source.get_vocab_size()


@pytest.mark.parametrize("pre", list(LLAMA_CPP_REGEXES))
def test_the_split_is_llama_cpps(pre):
    """Our pre-tokenizer (the model's own pattern, in Oniguruma) cuts words where llama.cpp's
    regexes, applied one after another with Python's `regex`, cut them."""
    tok = _pre_tokenizer(pre)
    for text in CORPUS:
        assert _words(tok, text) == llama_cpp_split(text, LLAMA_CPP_REGEXES[pre]), text


def test_the_corpus_tells_every_split_apart():
    """Else the tests above could pass with one pre-tokenizer swapped for another."""
    text = "\n".join(CORPUS)
    words = {pre: _words(_pre_tokenizer(pre), text) for pre in LLAMA_CPP_REGEXES}
    for a, b in combinations(words, 2):
        assert words[a] != words[b], (a, b)


def test_every_supported_name_has_a_tested_split():
    tested = {SPLITS[pre] for pre in LLAMA_CPP_REGEXES}
    assert {name for name, split in SPLITS.items() if split not in tested} == {"dbrx", "smaug-bpe"}
    assert SPLITS["dbrx"].pre_tokenizer() == SPLITS["llama-bpe"].pre_tokenizer()  # llama 3's split, merges kept


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def sentencepiece(request, tmp_path_factory):
    """(SentencePiece processor, our converted directory, whether a space is prepended); without
    the prefix as Gemma's files say (tokenizer.ggml.add_space_prefix = false)."""
    prefix = request.param
    sp = train_sentencepiece(add_dummy_prefix=prefix, control_symbols=SPECIALS[START:], user_defined_symbols=[
        USER_DEFINED])
    vocab = sentencepiece_vocabulary(sp)  # its processor cannot tell user-defined pieces: the proto's type 4
    types = [4 if t == USER_DEFINED else kind for t, kind in zip(vocab.tokens, vocab.types, strict=True)]
    vocab = Vocabulary("llama", vocab.tokens, types, scores=vocab.scores)
    root = tmp_path_factory.mktemp("spm")
    gguf = write_tokenizer_gguf(root / "spm.gguf", vocab, bos=1, eos=2, unk=0, eot=sp.piece_to_id(SPECIALS[END]),
                                add_space_prefix=None if prefix else False)
    write_tokenizer_files(gguf, root / "tok")
    return sp, root / "tok", prefix


def test_a_sentencepiece_gguf_tokenizes_as_sentencepiece(sentencepiece):
    sp, converted, _ = sentencepiece
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    fallback = 0
    for text in CORPUS:
        want = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.encode(text).ids == [1, *want], text  # llama.cpp adds BOS to a SentencePiece text by default
        assert ours.decode(ours.encode(text).ids) == text == sp.decode(want)
        fallback += sum(sp.is_byte(i) for i in want)
    assert fallback > 10  # the corpus needs byte fallback (characters the vocabulary lacks)


def test_sentencepiece_special_and_user_defined_tokens_are_matched_whole(sentencepiece):
    """llama.cpp matches them in the raw text and tokenizes each run of text between them on its
    own (with its own space prefix): llama_vocab::impl::tokenize, LLAMA_VOCAB_TYPE_SPM. So the
    prefix shows as a space after each such token when decoded, as in llama.cpp."""
    sp, converted, prefix = sentencepiece
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    start, end, think = (sp.piece_to_id(t) for t in (SPECIALS[START], SPECIALS[END], USER_DEFINED))
    want = [start, *sp.encode("user\nHi  there "), think, *sp.encode("x"), end, *sp.encode("\n 12 "), think]
    assert ours.encode(MIXED, add_special_tokens=False).ids == want
    shown = "<s><|start|> user\nHi  there <think> x<|end|> \n 12 <think>" if prefix else "<s>" + MIXED
    assert ours.decode(ours.encode(MIXED).ids, skip_special_tokens=False) == shown


def test_sentencepiece_merges_rank_by_the_joined_tokens_score():
    tokens = ["<unk>", "<0x41>", "a", "b", "c", "ab", "bc", "abc", "<s>"]
    types = [2, 6, 1, 1, 1, 1, 1, 1, 3]
    scores = [0, 0, -1, -2, -3, -5, -4, -6, 0]
    assert sentencepiece_merges(tokens, types, scores) == [["b", "c"], ["a", "b"], ["a", "bc"], ["ab", "c"]]


def test_chat_template_special_tokens_and_end_of_generation(byte_level, sentencepiece):
    for converted, bos in ((byte_level["llama-bpe"][1], BOS), (sentencepiece[1], 1)):
        config = json.loads((converted / "tokenizer_config.json").read_text())
        assert (config["bos_token"], config["add_bos_token"], config["add_eos_token"]) == (
            "<s>" if bos == 1 else SPECIALS[BOS], True, False)
        chat = ChatTokenizer(converted)
        ids = chat.encode_chat([{"role": "user", "content": "Hi"}])
        assert ids[:1] == [bos] and ids[1:2] != [bos]  # the template writes BOS once; encode_chat adds none
        assert chat.decode(ids, skip_special_tokens=False).startswith(config["bos_token"])
    generation = json.loads((byte_level["llama-bpe"][1] / "generation_config.json").read_text())
    assert generation == {"bos_token_id": BOS, "eos_token_id": [EOS, END]}  # <|end|> ends an answer too
    assert json.loads((byte_level["qwen2"][1] / "tokenizer_config.json").read_text())["add_bos_token"] is False


def test_the_converted_files_pass_the_engines_checks(byte_level, sentencepiece):
    from engine.generation.grammar import GrammarTokenizer
    from export.sources import check_converted_tokenizer

    prefix = b" " if sentencepiece[2] else b""  # SentencePiece's dummy prefix is a space in its first token
    for converted, first in ((byte_level["llama-bpe"][1], b""), (byte_level["deepseek-v3"][1], b""),
                             (sentencepiece[1], prefix)):
        check_converted_tokenizer(converted)  # one BOS, a chat template
        text = (converted / "tokenizer.json").read_text(encoding="utf-8")
        tok = Tokenizer.from_str(text)
        grammar = GrammarTokenizer(text, logits_width=tok.get_vocab_size(), eos_ids=[2])
        ids = tok.encode(" the answer:\n42", add_special_tokens=False).ids
        assert grammar.llg.decode_bytes(ids) == first + b" the answer:\n42"  # llguidance reads each token's bytes
    chat = ChatTokenizer(sentencepiece[1])
    assert chat.token_bytes(chat.token_id("<0xF0>")) == b"\xf0"


def test_a_sentencepiece_llama_gguf_exports_and_chats(tmp_path):
    """The way a Llama 2 / Mistral GGUF goes: export reads the tokenizer from the file (no torch,
    no transformers), the manifest stops on every end-of-generation id, the chat renders."""
    from export.exporter import export_model
    from export.options import ExportOptions

    sp = train_sentencepiece(control_symbols=SPECIALS[START:])
    end = sp.piece_to_id(SPECIALS[END])
    gguf = write_tokenizer_gguf(tmp_path / "llama2-style.gguf", sentencepiece_vocabulary(sp), bos=1, eos=2, unk=0,
                                eot=end, weights=True)
    report = export_model(gguf, tmp_path / "out", stages=1, options=ExportOptions(weights="fp32"), fingerprint="x")
    assert report.manifest.model.eos_token_ids == (2, end)
    chat = ChatTokenizer(tmp_path / "out" / "tokenizer")
    ids = chat.encode_chat([{"role": "user", "content": "Hello there"}])
    assert ids == [1, sp.piece_to_id(SPECIALS[START]), *sp.encode("user\nHello there"), end, *sp.encode("\n"),
                   sp.piece_to_id(SPECIALS[START]), *sp.encode("assistant\n")]


def test_an_unsupported_tokenizer_is_refused_before_any_stage_is_built(tmp_path, monkeypatch):
    from export.exporter import export_model
    from export.options import ExportError, ExportOptions

    def build(*args, **kwargs):
        raise AssertionError("a stage was built for a GGUF whose tokenizer cannot convert")

    monkeypatch.setattr("export.exporter._export_stages", build)
    vocab = Vocabulary("t5", ["<pad>", "</s>", "<unk>", "a"], [3, 3, 2, 1], scores=[0.0, 0.0, 0.0, -1.0])
    gguf = write_tokenizer_gguf(tmp_path / "t5.gguf", vocab, bos=None, eos=1, weights=True)
    with pytest.raises(ExportError, match="tokenizer is 't5'; supported: byte-level BPE"):
        export_model(gguf, tmp_path / "out", stages=1, options=ExportOptions(weights="fp32"), fingerprint="x")
    assert not (tmp_path / "out").exists()


def _fields(**changes):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.token_type": [1, 1, 1], "tokenizer.ggml.merges": ["a b"]}
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.mark.parametrize(("changes", "message"), [
    ({"tokenizer.ggml.model": "t5"}, "tokenizer is 't5'; supported: byte-level BPE .* and SentencePiece BPE"),
    ({"tokenizer.ggml.model": "bert"}, "tokenizer is 'bert'; supported: "),
    ({"tokenizer.ggml.model": "gemma4"}, "tokenizer is 'gemma4'; supported: "),
    ({"tokenizer.ggml.model": None}, "tokenizer is None; supported: "),
    ({"tokenizer.ggml.pre": "chameleon"}, "pre-tokenizer 'chameleon' is not supported; supported: .*deepseek-v3.*"
                                          "llama-bpe.*qwen2"),
    ({"tokenizer.ggml.merges": None}, "no merges"),
    ({"tokenizer.ggml.tokens": ["a", "a", "ab"]}, "lists a token twice"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "3 tokens but 2 token types"),
    ({"tokenizer.ggml.merges": ["ab"]}, "malformed merge 'ab'"),
    ({"tokenizer.ggml.add_bos_token": True}, "asks for a BOS token .* names none"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [0.0]}, "3 tokens but 1 scores"),
])
def test_what_does_not_convert_is_refused_by_name(tmp_path, changes, message):
    with pytest.raises(GGUFTokenizerError, match=message):
        tokenizer_files(_fields(**changes))
    with pytest.raises(GGUFTokenizerError):
        write_tokenizer_files(tmp_path / "unused.gguf", tmp_path / "out", metadata=_fields(**changes))
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "qwen35", "gpt-4o", "tekken"])
def test_transformers_gguf_loader_agrees_on_byte_level(byte_level, tmp_path, pre):
    """transformers' own GGUF tokenizer, for the pre-tokenizers it knows, from the same file.

    It does not take a whole-word token as is (llama.cpp's ignore_merges, which Llama 3's
    tokenizer.json sets too), so the word no merge reaches is left out for llama-bpe and tekken."""
    from transformers import AutoTokenizer

    source, converted = byte_level[pre]
    write_tokenizer_gguf(tmp_path / "t.gguf", byte_level_vocabulary(source, pre), bos=BOS, eos=EOS)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    texts = [t for t in CORPUS if pre not in IGNORES_MERGES or UNREACHABLE[1:] not in t]
    assert [t for t in texts if hf(t, add_special_tokens=False).input_ids
            != ours.encode(t, add_special_tokens=False).ids] == []


@pytest.mark.slow
def test_transformers_gguf_loader_agrees_on_sentencepiece(tmp_path):
    """Its SentencePiece tokenizer (Metaspace, prepend_scheme "first") adds no ``▁`` to a text that
    already starts with a space, where SentencePiece and llama.cpp do: those texts are left out
    (and it ignores tokenizer.ggml.add_space_prefix = false, so only the default is compared)."""
    from transformers import AutoTokenizer

    gguf = write_tokenizer_gguf(tmp_path / "spm.gguf", sentencepiece_vocabulary(train_sentencepiece()), bos=1, eos=2,
                                unk=0)
    write_tokenizer_files(gguf, tmp_path / "ours")
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    ours = Tokenizer.from_file(str(tmp_path / "ours" / "tokenizer.json"))
    for text in CORPUS:
        if not text.startswith(" "):
            assert hf(text).input_ids == ours.encode(text).ids, text
