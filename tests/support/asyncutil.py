"""Small helpers for tests that drive asyncio code from synchronous test functions."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

from console.shared.loop_thread import LoopThread

T = TypeVar("T")


def run(coro, timeout: float = 600):
    """Run ``coro`` to completion on a fresh loop, failing (not hanging) after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(coordinator, request) -> list[int]:
    """Every token id of one request."""
    return [e.token_id async for e in coordinator.stream(request)]


async def collect_events(coordinator, request) -> list:
    """Every TokenEvent of one request."""
    return [e async for e in coordinator.stream(request)]


async def until(predicate: Callable[[], T], what: str, timeout: float = 20.0, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true, and return that; after ``timeout``
    seconds fail with an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


@contextlib.contextmanager
def held_on(loop: LoopThread, factory, timeout: float = 60.0):
    """Enter the async context manager ``factory()`` as one task on ``loop``; yield its value, and
    leave it (on that loop) when the with-block ends."""
    ready: concurrent.futures.Future = concurrent.futures.Future()

    async def main():
        stop = asyncio.Event()
        try:
            async with factory() as value:
                ready.set_result((value, stop))
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    done = loop.submit(main())
    value, stop = ready.result(timeout)
    try:
        yield value
    finally:
        loop.call_soon(stop.set)
        done.result(timeout)


@contextlib.contextmanager
def held(factory, timeout: float = 60.0):
    """Enter the async context manager ``factory()`` on a loop thread of its own; yield its value."""
    with LoopThread("test-console") as loop, held_on(loop, factory, timeout) as value:
        yield value
