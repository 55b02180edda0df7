"""Choosing a packed step's tokens at the coordinator when a request asks more than the top-1 (pure).

A static (NPU-target) ring decodes greedily: its last stage answers each row's top-1. A request
with a constraint (``response_format``, a forced tool call) or asking for ``logprobs`` needs the
row's whole distribution, so a step that samples such a request's row asks the ring for the logits
of every row instead (a Packed frame with ``WANT_LOGITS``, answered by Logits [S, V]:
docs/PROTOCOL.md), and the tokens are chosen here: each asking row is masked by its request's
grammar (the matcher's mask for the next position), its greedy pick is the masked top-1, the pick
is consumed by the grammar, and its log-probabilities are the log-softmax of the raw logits at
temperature 1 after the mask. Rows of requests that ask nothing take the plain top-1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from engine.errors import GenerationError
from engine.generation.grammar import GrammarMatcher, GrammarStateError
from engine.generation.logprobs import token_logprobs
from engine.generation.request import Constraint
from engine.shards.step_answer import mask_in_place

T = TypeVar("T")


class MatcherSource(Protocol):
    """Where a packed generator gets its requests' grammar matchers (the coordinator layer's
    ``StreamConstraints`` over the model's vocabulary: built off the loop, cached tokenizer)."""

    @property
    def features(self) -> frozenset[str]: ...

    async def async_matcher(self, constraint: Constraint) -> GrammarMatcher: ...

    async def async_off_loop(self, work: Callable[..., T], *args: Any) -> T: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RowAsk:
    """What one request asks of the row that samples its next token."""

    matcher: GrammarMatcher | None = None
    logprobs: int | None = None

    @property
    def needs_logits(self) -> bool:
        return self.matcher is not None or self.logprobs is not None


@dataclass(frozen=True)
class RowChoice:
    """A row's token, its log-probabilities when asked, and whether its grammar is now complete
    with nothing left to add (the request finishes there with STOP)."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    stopped: bool = False


def choose_rows(logits: np.ndarray, asks: Mapping[int, RowAsk | None]) -> dict[int, RowChoice]:
    """The token of every sampled row (``asks``: row -> what its request asks, None for nothing)
    from the step's logits float32 [S, V]. Consumes each chosen token into its request's grammar;
    GenerationError when a grammar cannot build its mask or refuses every token."""
    out: dict[int, RowChoice] = {}
    for row, ask in asks.items():
        x = logits[row]
        if ask is None or not ask.needs_logits:
            out[row] = RowChoice(int(x.argmax()))
            continue
        if ask.matcher is not None:
            x = mask_in_place(np.array(x, dtype=np.float32), _mask(ask.matcher))
        token = int(x.argmax())
        if not np.isfinite(x[token]):
            raise GenerationError("the output constraint allows no token the model can give here")
        logprob, top = token_logprobs(x, token, ask.logprobs) if ask.logprobs is not None else (None, ())
        stopped = False
        if ask.matcher is not None:
            try:
                ask.matcher.consume([token])
            except GrammarStateError as exc:
                raise GenerationError(f"the output constraint failed: {exc}") from exc
            stopped = ask.matcher.is_stopped
        out[row] = RowChoice(token, logprob, top, stopped)
    return out


def _mask(matcher: GrammarMatcher) -> np.ndarray:
    try:
        return matcher.mask()
    except GrammarStateError as exc:
        raise GenerationError(f"the output constraint failed: {exc}") from exc
