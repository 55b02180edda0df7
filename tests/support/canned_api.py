"""A generator that answers canned text (ByteTokenizer ids, with made-up log-probabilities) and the
real API serving it on loopback in a thread, for the tool-call, logprobs and choices tests."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

from engine.api.server import async_run_api
from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from tests.support.api_helpers import CARD, EOS, SETTINGS, ByteTokenizer
from tests.support.fuzz_helpers import loop_thread


def fake_logprobs(token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A made-up distribution per token: the token itself most likely, then token+1, token+2, ..."""
    top = tuple(((token + j) % EOS, math.log(0.5 / (j + 1))) for j in range(k))
    return math.log(0.5), top


class CannedGenerator:
    """Answers ``answer(request, choice)`` (text) as ByteTokenizer ids then EOS; fills logprobs when asked."""

    def __init__(self, answer: str | Callable[[GenerationRequest, int], str]):
        self.answer = answer if callable(answer) else (lambda request, index: answer)
        self.model = replace(CARD, context_length=8192)
        self.requests: list[GenerationRequest] = []

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        return self._stream(request, len(self.requests) - 1)

    async def _stream(self, request: GenerationRequest, index: int) -> AsyncIterator[TokenEvent]:
        ids = [*self.answer(request, index).encode(), EOS][: request.max_new_tokens]
        for i, token in enumerate(ids):
            last = i + 1 == len(ids)
            finish = (FinishReason.STOP if token == EOS else FinishReason.LENGTH) if last else None
            logprob, top = fake_logprobs(token, request.logprobs) if request.logprobs is not None else (None, ())
            yield TokenEvent(token, i, finish=finish, logprob=logprob, top_logprobs=top)

    def metrics(self) -> dict[str, float]:
        return {}


@contextlib.contextmanager
def served(generator, *, pending: frozenset[str] | None = None, tokenizer=None, **settings) -> Iterator[str]:
    """The API over ``generator`` (``tokenizer``, default a ByteTokenizer) on loopback, on a loop in a
    thread; yields its /v1 URL."""
    options = replace(SETTINGS, max_prompt_tokens=6000, default_max_tokens=400, max_tokens_limit=1000, **settings)
    if pending is not None:
        options = replace(options, pending=pending)
    with loop_thread() as loop:
        api = loop.run(async_run_api(generator, tokenizer or ByteTokenizer(), options))
        try:
            yield api.url
        finally:
            loop.run(api.async_stop())
