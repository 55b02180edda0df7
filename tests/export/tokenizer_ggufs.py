"""Tiny tokenizers trained in code, and GGUFs that carry them the way llama.cpp's converter writes them.

Byte-level BPE: a `tokenizers` BPE trained with the pre-tokenizer llama.cpp applies for a
``tokenizer.ggml.pre`` name, written from llama.cpp's own regular expressions (its rewritten
forms, not the models' originals our converter writes: the two must split alike). SentencePiece:
a real SentencePiece BPE model (Llama 2's trainer settings), its pieces, scores and types
written as llama.cpp's ``_set_vocab_sentencepiece`` writes them.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from export.gguf_pretokenizers import DEEPSEEK_LETTERS
from tests.support.chat_gguf import add_tiny_llama

CORPUS = [
    "Hello, world!", " leading space", "  two leading spaces", "trailing spaces  ", "multiple    spaces inside",
    "tabs\tand\nnewlines\n\n\nthree", "\r\nwindows line\r\n", "Numbers: 1234567890 and 3.14159, 1,000,000",
    "x=12+34*5; y = 0.001e-9 // 42", "日本語のテキストと中文混合、句読点。", "한국어 문장입니다",
    "Ελληνικά и русский текст",
    "emoji 🎉🚀 and 👩‍💻 family 👨‍👩‍👧", "def f(a, b):\n    return a ** 2 + b  # comment\n",
    "don't I'll we've they're HE'S", "CamelCaseWord and snake_case_word", "https://example.com/path?q=1&r=2",
    "Ünïcödé naïve café", "ideographic\u3000space and nbsp\u00a0here", "", " ", "\n", "a" * 50, "1" * 20,
    "mixed123abc456 ~~~ !!! ??? ...", "unreachable Qzxj word", "العربية والفارسية", "हिन्दी भाषा",
    "ﬁ ligature and Ｆｕｌｌｗｉｄｔｈ",
]
TRAINING = CORPUS + [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "In 2024, 1234567 people paid $3.50 each (15% off). They're happy; we'll see.",
    "def main():\n    for i in range(10):\n        print(i, 'hello world')\n",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Привет, как дела? Γειά σου κόσμε! Bonjour à tous, ça va très bien.",
] * 4

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
SPECIALS = ["<|bos|>", "<|eos|>", "<|start|>", "<|end|>"]  # CONTROL
USER_DEFINED = "<think>"
UNREACHABLE = "\u0120Qzxj"  # " Qzxj" in the byte-level alphabet

# llama.cpp's regexes per pre-tokenizer name (src/llama-vocab.cpp, llm_tokenizer_bpe): its rewritten
# forms where Llama 3 / Qwen2's originals use (?i:...).
_LCPP_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LCPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_UP, _LO = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA_CPP_REGEXES: dict[str, tuple[str, ...]] = {
    "gpt-2": (_LCPP_GPT2,),
    "smollm": (r"\p{N}", _LCPP_GPT2),
    "llama-bpe": (_LCPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+",),
    "qwen2": (_LCPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",),
    "qwen35": (_LCPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+",),
    # GPT-4o and tekken: the models' own patterns. llama.cpp's rewrite of their case classes,
    # ((?=[\p{L}])([^a-z])), leaves out \p{M}, so it cuts combining marks (Devanagari, Arabic
    # vowel signs) off their letters; we follow the model's tokenizer.json.
    "gpt-4o": (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{_CONTRACTIONS}?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "tekken": (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "deepseek-llm": ("[\r\n]", rf"\s?[{DEEPSEEK_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                     "[一-龥ࠀ-一가-퟿]+", r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
IGNORES_MERGES = {"llama-bpe", "tekken"}  # llama.cpp's ignore_merges (Llama 3's tokenizer.json has it too)


def llama_cpp_split(text: str, regexes: tuple[str, ...]) -> list[str]:
    """llama.cpp's unicode_regex_split, with Python's `regex`: each pattern cuts the pieces the
    previous one left into its matches and the text between them."""
    import regex

    pieces = [text] if text else []
    for pattern in regexes:
        compiled, out = regex.compile(pattern), []
        for piece in pieces:
            at = 0
            for match in compiled.finditer(piece):
                if match.start() > at:
                    out.append(piece[at:match.start()])
                if match.end() > match.start():
                    out.append(match.group())
                at = max(at, match.end())
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


def train_byte_level(pre: str, vocab_size: int = 700) -> Tokenizer:
    """A byte-level BPE trained on :data:`TRAINING`, split as llama.cpp splits for ``pre``."""
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in LLAMA_CPP_REGEXES[pre]]
    tok = Tokenizer(models.BPE(ignore_merges=pre in IGNORES_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING, trainer)
    # A whole word no merge reaches: only a tokenizer that ignores merges for known words takes it at once.
    state = json.loads(tok.to_str())
    state["model"]["vocab"][UNREACHABLE] = len(state["model"]["vocab"])
    tok = Tokenizer.from_str(json.dumps(state))
    tok.add_tokens([USER_DEFINED])
    return tok


@dataclass(frozen=True)
class Vocabulary:
    """What a GGUF's tokenizer.ggml.* keys hold."""

    model: str
    tokens: list[str]
    types: list[int]
    merges: list[str] | None = None
    scores: list[float] | None = None
    pre: str | None = None


def byte_level_vocabulary(tok: Tokenizer, pre: str) -> Vocabulary:
    state = json.loads(tok.to_str())
    vocab = {**state["model"]["vocab"], USER_DEFINED: tok.token_to_id(USER_DEFINED)}
    tokens = [text for text, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.USER_DEFINED if t == USER_DEFINED
             else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return Vocabulary("gpt2", tokens, [int(t) for t in types], merges=merges, pre=pre)


def train_sentencepiece(vocab_size: int = 700, **options: Any) -> Any:
    """A SentencePiece BPE model with Llama 2's trainer settings (byte fallback, digits split, no
    normalisation, a dummy prefix), trained on :data:`TRAINING`; the processor."""
    import sentencepiece as spm

    model = io.BytesIO()
    settings = dict(model_type="bpe", vocab_size=vocab_size, byte_fallback=True, split_digits=True,
                    normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
                    allow_whitespace_only_pieces=True, character_coverage=0.98, unk_id=0, bos_id=1, eos_id=2,
                    pad_id=-1, minloglevel=2, num_threads=1, hard_vocab_limit=False)
    settings.update(options)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TRAINING), model_writer=model, **settings)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_vocabulary(sp: Any) -> Vocabulary:
    """Pieces, scores and types as llama.cpp's converter reads them from tokenizer.model."""
    tokens, types, scores = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                else gguf.TokenType.NORMAL)
        types.append(int(kind))
    return Vocabulary("llama", tokens, types, scores=scores)


def write_tokenizer_gguf(path: Path, vocab: Vocabulary, *, bos: int | None, eos: int | None,
                         add_bos: bool | None = None, add_space_prefix: bool | None = None, eot: int | None = None,
                         pad: int | None = None, unk: int | None = None, template: str | None = CHAT_TEMPLATE,
                         weights: bool = False) -> Path:
    """A GGUF holding a tokenizer (and the architecture key every GGUF has); with ``weights``, a
    2-layer Llama of random weights around it, to export."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if weights:
        add_tiny_llama(writer, len(vocab.tokens))
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    for value, add in ((bos, writer.add_bos_token_id), (eos, writer.add_eos_token_id), (eot, writer.add_eot_token_id),
                       (pad, writer.add_pad_token_id), (unk, writer.add_unk_token_id)):
        if value is not None:
            add(value)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


