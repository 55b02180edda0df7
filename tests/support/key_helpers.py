"""A scripted generator and an API served on a thread of its own, for the key and audit tests
(the real aiohttp app and the real `openai` client; the generator is not what they test)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from tests.support.api_helpers import CARD, EOS, ByteTokenizer


class ScriptedGenerator:
    """Answers every request with the bytes of ``answer`` then EOS (ByteTokenizer ids)."""

    def __init__(self, answer: str = "okay") -> None:
        self.answer = answer
        self.model = CARD
        self.requests: list[GenerationRequest] = []

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        ids = [*self.answer.encode(), EOS][: request.max_new_tokens]
        for i, token in enumerate(ids):
            await asyncio.sleep(0)
            last = i + 1 == len(ids)
            yield TokenEvent(token, i, finish=(FinishReason.STOP if token == EOS else FinishReason.LENGTH)
                             if last else None)

    def metrics(self) -> dict[str, float]:
        return {}


@contextlib.contextmanager
def serving(generator: Any, settings: Any, *, timeout: float = 60.0, **api_kw: Any) -> Iterator[str]:
    """``async_run_api(generator, ByteTokenizer(), settings, **api_kw)`` on loopback in a thread with
    its own loop; yields the API's base URL (…/v1) and stops it on exit."""
    from engine.api.server import async_run_api

    ready: concurrent.futures.Future = concurrent.futures.Future()
    control: dict = {}

    async def main() -> None:
        control["loop"], control["stop"] = asyncio.get_running_loop(), asyncio.Event()
        try:
            api = await async_run_api(generator, ByteTokenizer(), settings, **api_kw)
        except BaseException as exc:
            ready.set_exception(exc)
            raise
        try:
            ready.set_result(api.url)
            await control["stop"].wait()
        finally:
            await api.async_stop()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="key-test-api")
    thread.start()
    try:
        yield ready.result(timeout)
    finally:
        if "stop" in control:
            control["loop"].call_soon_threadsafe(control["stop"].set)
        thread.join(timeout)
        assert not thread.is_alive(), "the API test server did not stop"
