"""Background tasks that are neither lost nor silent (python-zeroconf's ``_background_tasks``).

``asyncio`` keeps only a weak reference to a task: one nobody holds may be collected mid-flight,
and an exception nobody retrieves surfaces at best as "Task exception was never retrieved", at
garbage collection, without saying which task. :func:`start_task` is the one way Deskfleet starts
a task it does not await on the spot: it names the task, holds it until it finishes (in the
owner's set when one is given, else in this module's), and logs an exception the moment the task
ends with one, under the task's name. A cancelled task is not an error and logs nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)
_RUNNING: set[asyncio.Task[Any]] = set()  # the strong references of tasks no owner keeps


def start_task(coro: Coroutine[Any, Any, T], *, name: str, logger: logging.Logger | None = None,
               keep: set[asyncio.Task[Any]] | None = None, level: int = logging.WARNING) -> asyncio.Task[T]:
    """Start ``coro`` on the running loop as the task ``name`` and return it.

    The task stays referenced until it finishes: in ``keep`` (an owner's set, which it may cancel
    at its own stop) or in a set of this module. When it ends with an exception, ``logger`` (this
    module's when None) logs it at ``level`` with its traceback and the task's name; an owner that
    also awaits the task still gets the exception. Must be called on the loop's thread.
    """
    task = asyncio.get_running_loop().create_task(coro, name=name)
    held = _RUNNING if keep is None else keep
    held.add(task)
    task.add_done_callback(lambda t: _finished(t, held, logger or log, level))
    return task


def _finished(task: asyncio.Task[Any], held: set[asyncio.Task[Any]], logger: logging.Logger, level: int) -> None:
    held.discard(task)
    if task.cancelled():
        return
    exc = task.exception()  # retrieves it: asyncio no longer reports it as "never retrieved"
    if exc is not None:
        logger.log(level, "background task %s failed: %s: %s", task.get_name(), type(exc).__name__, exc,
                   exc_info=exc)


def running_count() -> int:
    """How many tasks :func:`start_task` holds for no owner (for tests and diagnostics)."""
    return len(_RUNNING)
