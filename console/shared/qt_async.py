"""The Qt half of the loop-thread arrangement: run a coroutine on a :class:`LoopThread` and get its
outcome back on the GUI thread.

Qt widgets may only be touched on the thread that owns them, and asyncio objects only on their
loop's thread. :class:`QtAsync` is the one crossing point: work goes to the loop with
``run_coroutine_threadsafe``; results, errors and progress come back as a queued signal, so every
callback the views register runs on the GUI thread. Every call has a timeout that ends in
:class:`LoopTimeout`, so a dead network never leaves a dialog waiting for ever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from PySide6.QtCore import QCoreApplication, QEvent, QObject, Qt, Signal, Slot

from console.shared.loop_thread import LoopThread, LoopTimeout

log = logging.getLogger(__name__)


class QtAsync(QObject):
    """``call(coro, timeout=..., on_result=..., on_error=...)``; ``post(fn, *args)`` from any thread.

    Must be created on the GUI thread, and must outlive the loop thread's work: stop the loop
    (or cancel the calls) before deleting it.
    """

    _deliver = Signal(object)  # a zero-argument callable, run on the GUI thread

    def __init__(self, loop: LoopThread, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.loop = loop
        # Queued even when emitted on the GUI thread: a callback never runs inside the caller's frame.
        self._deliver.connect(self._run, Qt.ConnectionType.QueuedConnection)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the GUI thread (safe to call from the loop thread)."""
        self._deliver.emit(functools.partial(fn, *args))

    def call(self, coro: Coroutine[Any, Any, Any], *, timeout: float, what: str = "the request",
             on_result: Callable[[Any], None] | None = None,
             on_error: Callable[[BaseException], None] | None = None) -> concurrent.futures.Future:
        """Run ``coro`` on the loop within ``timeout`` seconds; report back on the GUI thread.

        ``on_error`` receives the exception (``asyncio.CancelledError`` when the returned future
        was cancelled, :class:`LoopTimeout` when the time ran out). Without ``on_error`` a
        failure is logged.
        """
        future = self.loop.submit(_within(coro, timeout, what))
        future.add_done_callback(lambda f: self.post(self._settle, f, on_result, on_error, what))
        return future

    @staticmethod
    def _settle(future: concurrent.futures.Future, on_result, on_error, what: str) -> None:
        if future.cancelled():
            error: BaseException | None = asyncio.CancelledError()
        else:
            error = future.exception()
        if error is None:
            if on_result is not None:
                on_result(future.result())
        elif on_error is not None:
            on_error(error)
        elif not isinstance(error, asyncio.CancelledError):
            log.warning("%s failed: %s", what, error)

    @Slot(object)
    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a broken callback must not take the event loop down
            log.exception("GUI callback failed")


async def _within(coro: Coroutine[Any, Any, Any], timeout: float, what: str) -> Any:
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            return await coro
    except TimeoutError:
        if deadline.expired():
            raise LoopTimeout(f"{what} did not finish within {timeout:g} s") from None
        raise


def drop_pending_quit(app: QCoreApplication) -> None:
    """Discard a Quit event still queued when ``app.exec()`` has returned (the last window closing
    posts one): handled later, outside exec, it would leave the application quitting for good, and
    every later event loop in this process (a second run, a test) would return at once."""
    QCoreApplication.removePostedEvents(app, QEvent.Type.Quit)
