"""Blocking work of one request (rendering and tokenising a long prompt) away from the event loop,
which also runs the coordinator's steps."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a short-lived daemon thread: rendering and tokenising a long prompt takes
    a while, and the loop also runs the coordinator's steps. (Not the loop's default executor:
    its threads outlive the server.) Admission (``max_concurrent``) bounds how many wait."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting request, which maps it to an answer
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="deskfleet-tokenize", daemon=True).start()
    return await done
