"""One asyncio loop thread shared by the tests of a module, for a service (or a fleet) that is
started once for all of them instead of once per test.

Each test gets the loop with a default executor of its own, shut down (its threads joined) when
the test ends: executor threads start on demand, and one started during a test and still alive
after it would count as leaked by ``no_leaked_threads``."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

from console.shared.loop_thread import LoopThread

T = TypeVar("T")


class SharedLoop:
    def __init__(self, name: str) -> None:
        self.thread = LoopThread(name)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> SharedLoop:
        self.thread.start()
        self.new_executor()
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str = "the call") -> T:
        return self.thread.run(coro, timeout, what)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self.thread.submit(coro)

    def new_executor(self) -> None:
        """A new default executor for the loop; the one before it shut down, its threads joined."""
        old = self._executor
        new = self._executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix=f"{self.thread.name}-exec")

        async def swap() -> None:
            asyncio.get_running_loop().set_default_executor(new)

        self.run(swap(), 10, "setting the loop's executor")
        if old is not None:
            old.shutdown(wait=True)

    def stop(self) -> None:
        self.thread.stop()  # shuts the default executor down
        if self._executor is not None:
            self._executor.shutdown(wait=True)
