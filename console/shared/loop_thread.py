"""One asyncio loop in one background thread, with a synchronous facade that always times out.

The desktop shells (the tray agent and the console) keep Qt's event loop on the main thread and
do all their networking on one asyncio loop beside it. This module is the Qt-free half of that
arrangement: it starts the loop, runs coroutines on it from any thread, and stops it cleanly —
pending tasks cancelled, the default executor's threads joined — so no thread outlives the
window that needed it (the test suite fails a test that leaks one). The Qt half, which hands
results back to the GUI thread, is :mod:`console.shared.qt_async`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from engine.errors import DeskfleetError

log = logging.getLogger(__name__)

T = TypeVar("T")
STOP_TIMEOUT_S = 30.0


class LoopThreadError(DeskfleetError):
    """Raised when work is handed to a loop thread that is not running (not started, or stopped)."""


class LoopTimeout(LoopThreadError):
    """Raised when a call into the loop, or the loop's own shutdown, takes longer than its timeout."""


class LoopThread:
    """``start()``, then ``submit``/``run`` coroutines from any thread; ``stop()`` joins the thread.

    The thread is not a daemon: a loop that will not stop is an error to report, not something
    to abandon at interpreter exit.
    """

    def __init__(self, name: str = "deskfleet-loop") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> LoopThread:
        if self._thread is not None:
            raise LoopThreadError(f"{self.name} was already started; a LoopThread runs once")
        self._thread = threading.Thread(target=self._main, name=self.name)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise LoopTimeout(f"the {self.name} event loop did not start within {timeout:g} s")
        if self._failed is not None:
            raise LoopThreadError(f"the {self.name} event loop failed to start: {self._failed}") from self._failed
        return self

    def _main(self) -> None:
        try:
            loop = asyncio.new_event_loop()
        except BaseException as exc:  # pragma: no cover - an OS out of file descriptors
            self._failed = exc
            self._ready.set()
            return
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(_cancel_pending(loop))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    @property
    def running(self) -> bool:
        return self._loop is not None and self._thread is not None and self._thread.is_alive() \
            and not self._loop.is_closed()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise LoopThreadError(f"{self.name} has not been started")
        return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Cancel what is still running on the loop, close it, and join the thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        if self.in_loop_thread():
            raise LoopThreadError(f"{self.name} cannot be stopped from its own thread")
        with contextlib.suppress(RuntimeError):  # already closing
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise LoopTimeout(f"the {self.name} event loop did not stop within {timeout:g} s; "
                              "a task on it ignores cancellation")

    def __enter__(self) -> LoopThread:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- calls from other threads --------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; cancelling the returned future cancels the task."""
        if not self.running:
            coro.close()
            raise LoopThreadError(f"the {self.name} event loop is not running; start it first")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str = "the call") -> T:
        """Run ``coro`` on the loop and wait for its result; cancel it and raise after ``timeout``."""
        if self.in_loop_thread():
            coro.close()
            raise LoopThreadError(f"{what}: a blocking call from the {self.name} thread itself would deadlock")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise LoopTimeout(f"{what} did not finish within {timeout:g} s") from None

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread (for loop-only objects such as asyncio events)."""
        if not self.running:
            raise LoopThreadError(f"the {self.name} event loop is not running")
        self.loop.call_soon_threadsafe(fn, *args)


async def _cancel_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task still on the loop and wait for them, as ``asyncio.run`` does at its end."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks(loop) if t is not current and not t.done()]
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for task, result in zip(tasks, results, strict=True):
        if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
            log.warning("task %s failed while its loop was stopping: %s", task.get_name(), result)
