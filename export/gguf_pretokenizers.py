"""llama.cpp's byte-level BPE pre-tokenizers, as `tokenizers` pre-tokenizers.

A byte-level GGUF (``tokenizer.ggml.model = gpt2``) names how its text is cut into words before
the merges run: ``tokenizer.ggml.pre``. llama.cpp (``llm_tokenizer_bpe`` in ``src/llama-vocab.cpp``)
maps each name to a list of regular expressions applied one after another, each cutting the
pieces the previous one left, with the text between matches kept as pieces of its own. That is
`tokenizers`' ``Split(pattern, behavior="isolated")`` in a ``Sequence``, followed by the byte-level
alphabet (``ByteLevel(use_regex=False)``). The patterns below are the models' own (their
``tokenizer.json``), which llama.cpp only rewrites where its regex engine lacks a feature.

Each row also carries what llama.cpp sets beside the split: ``ignore_merges`` (a word that is a
whole token is taken as is, as Llama 3's tokenizer does) and whether BOS is added when the GGUF
does not say (``tokenizer.ggml.add_bos_token`` wins when present).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# GPT-2's split (tokenizers' ByteLevel(use_regex=True) applies it itself).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM (v1/v2): newlines alone, then Latin/Greek/Cyrillic/... letter runs, ASCII and
# full-width punctuation runs, trailing spaces, CJK/Hangul runs, digit runs.
DEEPSEEK_LETTERS = (  # the cased letters (\p{LC}) of the alphabetic scripts; escapes where NFC would fold them
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffcℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛ"
    "Ꜣ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_DEEPSEEK_LLM = ("[\r\n]", rf"\s?[{DEEPSEEK_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                 "[一-龥ࠀ-一가-퟿]+", r"\p{N}+")
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
# DeepSeek V3/R1: numbers in threes, CJK/kana runs, then the rest.
_DEEPSEEK_V3 = (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Split:
    """How one family of byte-level vocabularies cuts text into words.

    ``patterns``: applied in order, each isolating its matches within the previous pieces; empty
    means GPT-2's own regex. ``digits``: every digit a piece of its own first (StarCoder's family).
    """

    patterns: tuple[str, ...] = ()
    digits: bool = False
    ignore_merges: bool = False
    adds_bos: bool = False  # llama.cpp's default when the GGUF has no tokenizer.ggml.add_bos_token

    def pre_tokenizer(self) -> dict[str, Any]:
        """The `tokenizers` pre-tokenizer (its JSON form)."""
        steps: list[dict[str, Any]] = []
        if self.digits:
            steps.append({"type": "Digits", "individual_digits": True})
        steps += [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
                  for p in self.patterns]
        steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": not self.patterns})
        return steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps}


_GPT2 = Split()
_STARCODER = Split(digits=True)
_LLAMA3_SPLIT = Split((_LLAMA3,), ignore_merges=True, adds_bos=True)
_QWEN2_SPLIT = Split((_QWEN2,))

# llama.cpp's tokenizer.ggml.pre names -> their split (names sharing a split are llama.cpp's own groups).
SPLITS: dict[str, Split] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "exaone4"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _STARCODER),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("dbrx", "smaug-bpe"), Split((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_SPLIT),
    "qwen35": Split((_QWEN35,)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "minimax-m2"), Split((_GPT4O,))),
    "tekken": Split((_TEKKEN,), ignore_merges=True, adds_bos=True),
    "deepseek-llm": Split(_DEEPSEEK_LLM),
    "deepseek-coder": Split(_DEEPSEEK_CODER),
    "deepseek-v3": Split(_DEEPSEEK_V3),
}
