"""Grammar-constrained decoding: llguidance's view of a tokenizer, a per-stream matcher, and masks.

A constraint (a JSON schema from ``response_format``, a tool call's arguments: see
:mod:`engine.generation.response_format`) compiles to a :class:`Grammar`, which is text and
knows no tokenizer. A :class:`GrammarTokenizer` is built once per model from its
``tokenizer.json`` for the model's logits width ``V`` (which may exceed the tokenizer's
vocabulary: the extra ids are never allowed) and its end-of-sequence ids. Each constrained
stream then owns a :class:`GrammarMatcher`, which answers the allowed-token mask for the next
position and follows the tokens the stream commits.

A mask is packed: ``uint32 [ceil(V/32)]``, little-endian words, token ``t`` allowed when bit
``t % 32`` of word ``t // 32`` is set (llguidance's layout, V/8 bytes: ~6 KB for a 49,152-token
vocabulary). :func:`apply_mask` turns it into ``-inf`` logits for the paths that hold full logits.

End of sequence: the matcher allows the model's EOS ids exactly when the text so far is
complete (``is_accepting``); once nothing but EOS can follow (``is_stopped``) the mask holds
only the EOS ids, so a caller may finish the stream there without spending a step on it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np

from engine.errors import GenerationError
from engine.shards import step_answer

_WORD_BITS = 32
# Errors without the parser state and grammar dump llguidance adds by default: they reach a
# client (a 400) and the logs, and the schema is the client's own text.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(GenerationError):
    """A request's constraint cannot be compiled: a malformed ``response_format``, a JSON schema
    llguidance rejects (an unknown type, a bad ``$ref``, an unsupported regex, an unimplemented
    keyword under ``strict``). The message names the field and the problem; the API answers 400."""


class GrammarStateError(GenerationError):
    """A matcher or a mask was used wrongly, not a bad request: a token the grammar does not allow
    was committed, a rollback goes back further than what was consumed, a mask's width disagrees
    with the logits', or a tokenizer does not fit the model's logits width."""


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: llguidance's grammar text (JSON), independent of any tokenizer.

    ``description`` names it in messages ("response_format json_schema 'person'");
    ``warnings`` are the schema keywords llguidance ignored (only when not strict).
    """

    source: str
    description: str
    warnings: tuple[str, ...] = ()


def mask_width(vocab_size: int) -> int:
    """Words in a packed mask for ``vocab_size`` logits: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // _WORD_BITS)


def check_grammar(grammar_source: str, description: str) -> tuple[str, ...]:
    """Validate llguidance grammar text without a tokenizer; returns its warnings.

    Raises :class:`GrammarError` naming ``description`` and llguidance's reason.
    """
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_source, None, limits=_LIMITS)
    if is_error:
        raise GrammarError(f"{description} cannot be used for constrained decoding: {_first_line(messages)}")
    return tuple(messages)


def _first_line(messages: Sequence[str]) -> str:
    text = messages[0] if messages else "unknown error"
    return " ".join(text.split()) if len(text) < 400 else " ".join(text[:400].split()) + " ..."


class GrammarTokenizer:
    """llguidance's tokenizer for one model: its ``tokenizer.json``, logits width and EOS ids.

    Building one takes ~0.4 s for a 49,152-token vocabulary: use :func:`load_grammar_tokenizer`,
    which keeps the last few. Shared read-only by every matcher of the model.
    """

    def __init__(self, tokenizer_json: str, *, logits_width: int, eos_ids: Sequence[int]):
        """``tokenizer_json`` is the text of a HF ``tokenizer.json``."""
        eos = tuple(int(t) for t in eos_ids)
        if not eos:
            raise GrammarStateError("a constrained stream needs the model's end-of-sequence ids; none were given")
        if any(not 0 <= t < logits_width for t in eos):
            raise GrammarStateError(f"end-of-sequence ids {eos} lie outside the logits width {logits_width}")
        try:
            self._tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=logits_width, eos_token=list(eos))
        except ValueError as exc:
            if "vocab size too small" in str(exc):  # "...; <logits_width> vs <the tokenizer's>"
                raise GrammarStateError(
                    f"the tokenizer does not fit a model with {logits_width} logits: {exc}") from exc
            raise GrammarStateError(f"llguidance cannot read this tokenizer.json: {exc}") from exc
        self.logits_width = logits_width
        self.mask_width = mask_width(logits_width)
        self.eos_ids = eos

    @property
    def llg(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer itself (for llguidance calls this module does not wrap)."""
        return self._tok

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher for one stream. Raises :class:`GrammarError` when the grammar does not
        build against this tokenizer (rare once :func:`check_grammar` passed: a lexer limit)."""
        return GrammarMatcher(self, grammar)

    def text(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` as the grammar sees it (special tokens as their names)."""
        return self._tok.decode_str(list(token_ids))


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(path: str, mtime_ns: int, logits_width: int, eos_ids: tuple[int, ...]) -> GrammarTokenizer:
    del mtime_ns  # part of the key only: a rewritten tokenizer.json is read again
    try:
        text = Path(path).read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, ValueError) as exc:
        raise GrammarStateError(f"cannot read the tokenizer {path}: {exc}") from exc
    return GrammarTokenizer(text, logits_width=logits_width, eos_ids=eos_ids)


def load_grammar_tokenizer(tokenizer: Path | str, *, logits_width: int, eos_ids: Sequence[int]) -> GrammarTokenizer:
    """The :class:`GrammarTokenizer` of a ``tokenizer.json`` (or a directory holding one), cached."""
    path = Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as exc:
        raise GrammarStateError(f"no tokenizer at {path}: {exc}") from exc
    return _cached_tokenizer(str(path.resolve()), mtime, logits_width, tuple(int(t) for t in eos_ids))


class GrammarMatcher:
    """One stream's place in its grammar: the mask for the next token, the tokens committed.

    Not thread-safe; one owner (the stream's scheduler) calls it. ``consume`` is all-or-nothing
    and ``rollback`` undoes the last tokens consumed, so a speculative draft can be tried and
    taken back (or use :meth:`draft_masks`, which never advances the matcher).
    """

    def __init__(self, tokenizer: GrammarTokenizer, grammar: Grammar):
        self._tokenizer = tokenizer
        self.grammar = grammar
        self._m = llguidance.LLMatcher(tokenizer.llg, grammar.source, log_level=0, limits=_LIMITS)
        if self._m.is_error():
            raise GrammarError(
                f"{grammar.description} cannot be used for constrained decoding: {_first_line([self._m.get_error()])}")
        self._consumed = 0

    def fork(self) -> GrammarMatcher:
        """A matcher in this one's state that shares nothing mutable with it (llguidance's
        ``deep_copy``, microseconds): one build serves many streams."""
        twin = object.__new__(GrammarMatcher)
        twin._tokenizer, twin.grammar, twin._consumed = self._tokenizer, self.grammar, self._consumed
        twin._m = self._m.deep_copy()
        return twin

    @property
    def llg(self) -> llguidance.LLMatcher:
        """The llguidance matcher itself (for its batch calls: ``LLExecutor``)."""
        return self._m

    @property
    def consumed(self) -> int:
        """Tokens committed so far (what :meth:`rollback` can take back)."""
        return self._consumed

    @property
    def is_accepting(self) -> bool:
        """The text so far is complete: EOS is allowed (more may still be)."""
        return self._m.is_accepting()

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS can follow (or EOS was consumed): the stream may finish here."""
        return self._m.is_stopped()

    @property
    def stop_reason(self) -> str:
        """llguidance's reason ("NotStopped", "NoExtension", "EndOfSentence", ...)."""
        return self._m.stop_reason()

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the next position's mask into ``out``: uint32 [mask_width], C-contiguous (a row
        of a batch's [R, mask_width] array works)."""
        _check_mask_row(out, self._tokenizer.mask_width)
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._raise_if_error("computing the mask")

    def mask(self) -> np.ndarray:
        """The next position's mask: a new uint32 [mask_width]."""
        out = np.empty(self._tokenizer.mask_width, dtype=np.uint32)
        self.fill_mask(out)
        return out

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (one validation, no mask)."""
        if token_id in self._tokenizer.eos_ids:
            # llguidance's validate_tokens counts EOS only once stopped, not where the text is
            # complete but could go on ("12" of an integer); its mask allows EOS in both.
            return self._m.is_accepting()
        return self._m.validate_tokens([int(token_id)]) == 1

    def consume(self, token_ids: Sequence[int]) -> None:
        """Commit ``token_ids`` (a step's accepted tokens, EOS included when chosen).

        All or nothing: when one is not allowed, nothing is consumed and
        :class:`GrammarStateError` names it; the caller ignored the mask.
        """
        ids = [int(t) for t in token_ids]
        if not ids:
            return
        if self._m.validate_tokens(ids) == len(ids):  # the common case, in one call
            if not self._m.consume_tokens(ids):
                self._raise_if_error("consuming tokens")
            self._consumed += len(ids)
            return
        done = 0  # one at a time, to take an EOS where the text is complete and to name the refusal
        for token in ids:
            if not self.allows(token):
                self._m.rollback(done)
                raise GrammarStateError(
                    f"token {token} ({self._tokenizer.text([token])!r}) at position {self._consumed + done} is not "
                    f"allowed by {self.grammar.description}; the token was chosen without the mask")
            self._m.consume_token(token)
            self._raise_if_error("consuming a token")
            done += 1
        self._consumed += done

    def rollback(self, count: int) -> None:
        """Take back the last ``count`` consumed tokens (a rejected draft's)."""
        if not 0 <= count <= self._consumed:
            raise GrammarStateError(f"cannot roll back {count} tokens: {self._consumed} were consumed")
        if count and not self._m.rollback(count):
            self._raise_if_error("rolling back")
        self._consumed -= count

    def draft_masks(self, draft: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """Masks for verifying a speculative draft: row 0 for the next position, row i for the
        position after draft token i. uint32 [len(draft) + 1, mask_width].

        The matcher ends where it started. From the first draft token the grammar refuses, the
        remaining rows repeat that position's mask: verification rejects the draft there (the
        target's masked pick cannot be a refused token), so those rows are never used.
        """
        rows = len(draft) + 1
        if out is None:
            out = np.empty((rows, self._tokenizer.mask_width), dtype=np.uint32)
        elif out.shape != (rows, self._tokenizer.mask_width) or out.dtype != np.uint32:
            raise GrammarStateError(
                f"draft masks need uint32 [{rows}, {self._tokenizer.mask_width}], got {out.dtype} {out.shape}")
        advanced = 0
        try:
            self.fill_mask(out[0])
            for i, token in enumerate(draft, start=1):
                if self._m.is_stopped() or not self.allows(token):
                    out[i:] = out[i - 1]
                    break
                self._m.consume_token(int(token))
                advanced += 1
                self.fill_mask(out[i])
        finally:
            if advanced:
                self._m.rollback(advanced)
        return out

    def _raise_if_error(self, doing: str) -> None:
        if self._m.is_error():
            raise GrammarStateError(
                f"{self.grammar.description}: the matcher failed {doing}: {_first_line([self._m.get_error()])}")


def _check_mask_row(out: np.ndarray, width: int) -> None:
    if out.dtype != np.uint32 or out.shape != (width,) or not out.flags["C_CONTIGUOUS"]:
        raise GrammarStateError(
            f"a mask row must be a C-contiguous uint32 [{width}], got {out.dtype} {out.shape}")


def fill_masks(matchers: Sequence[GrammarMatcher], out: np.ndarray) -> np.ndarray:
    """Each matcher's next mask into row i of ``out`` (uint32 [len(matchers), mask_width])."""
    if out.ndim != 2 or out.shape[0] != len(matchers):
        raise GrammarStateError(f"{len(matchers)} matchers need {len(matchers)} mask rows, got shape {out.shape}")
    for row, matcher in zip(out, matchers, strict=True):
        matcher.fill_mask(row)
    return out


def unpack_mask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [..., vocab_size] from packed uint32 [..., ceil(vocab_size/32)] (True = allowed),
    checked: :func:`engine.shards.step_answer.unpack_mask` with GrammarStateError for a bad mask."""
    words = np.asarray(mask)
    _check_packed(words, vocab_size)
    return step_answer.unpack_mask(words, vocab_size)


def _check_packed(words: np.ndarray, vocab_size: int) -> None:
    if words.dtype != np.uint32:
        raise GrammarStateError(f"a packed mask is uint32, got {words.dtype}")
    if words.shape[-1] != mask_width(vocab_size):
        raise GrammarStateError(
            f"a mask of {words.shape[-1]} words does not fit {vocab_size} logits "
            f"(that takes {mask_width(vocab_size)} words)")


def apply_mask(logits: np.ndarray, mask: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """Logits with ``-inf`` where the mask disallows: logits [V] or [R, V] float, mask [W] or
    [R, W] uint32 (W = ceil(V/32); one mask row broadcasts over R logits rows).

    Returns ``out`` (a new array by default; pass ``out=logits`` to mask in place). The masking is
    the last stage's (:func:`engine.shards.step_answer.mask_in_place`), checked here first.
    """
    x = np.asarray(logits)
    if not np.issubdtype(x.dtype, np.floating):
        raise GrammarStateError(f"logits must be floating point, got {x.dtype}")
    m = np.asarray(mask)
    if x.ndim not in (1, 2) or m.ndim > x.ndim or m.ndim == 0 or (m.ndim == 2 and m.shape[0] != x.shape[0]):
        raise GrammarStateError(f"a mask of shape {m.shape} does not fit logits of shape {x.shape}")
    _check_packed(m, x.shape[-1])
    if out is None:
        out = x.copy()
    elif out is not x:
        np.copyto(out, x)
    return step_answer.mask_in_place(out, m)
