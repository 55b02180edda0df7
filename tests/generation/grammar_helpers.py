"""Real tokenizers for the grammar tests, and a decode loop that stands in for a model.

The loop draws logits at random (a model that knows nothing), masks them with the matcher's mask
and picks greedily or by seeded sampling: whatever comes out is the grammar's doing alone. The text
is decoded by the ``tokenizers`` library, not by llguidance, so the check is independent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from engine.generation.grammar import GrammarMatcher, GrammarTokenizer, apply_mask, load_grammar_tokenizer
from engine.generation.request import SamplingParams
from engine.generation.sampling import choose
from engine.generation.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class Vocab:
    """A real tokenizer directory with its grammar tokenizer for a given logits width."""

    directory: Path
    grammar: GrammarTokenizer
    text: Tokenizer
    eos_id: int

    def decode(self, ids: list[int]) -> str:
        return self.text.decode(ids, skip_special_tokens=True)


def vocab_of(directory: Path, logits_width: int | None = None) -> Vocab:
    chat = ChatTokenizer(directory)
    eos = chat.token_id(chat.eos_token)
    assert eos is not None
    text = Tokenizer.from_file(str(directory / "tokenizer.json"))
    width = logits_width or text.get_vocab_size(with_added_tokens=True)
    return Vocab(directory, load_grammar_tokenizer(directory, logits_width=width, eos_ids=[eos]), text, eos)


@dataclass(frozen=True)
class Decoded:
    ids: list[int]  # without the final EOS
    stopped: bool  # EOS chosen (or the grammar had nothing but EOS left)


def decode(vocab: Vocab, matcher: GrammarMatcher, seed: int, *, budget: int = 300,
           temperature: float = 0.0) -> Decoded:
    """Pick tokens from random logits under the mask until EOS or ``budget`` tokens."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=temperature, seed=seed)
    draw = np.random.default_rng(seed + 1)
    ids: list[int] = []
    for _ in range(budget):
        logits = rng.normal(0.0, 3.0, vocab.grammar.logits_width).astype(np.float32)  # [V]
        token, _ = choose(apply_mask(logits, matcher.mask()), params, draw)
        matcher.consume([token])
        if token in vocab.grammar.eos_ids:
            return Decoded(ids, True)
        ids.append(token)
    return Decoded(ids, False)
