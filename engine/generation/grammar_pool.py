"""Grammar compilation off the event loop, bounded: one small worker pool per process.

A constrained request's matcher (:class:`~engine.generation.grammar.GrammarMatcher`) takes
llguidance anywhere from a millisecond to seconds to build, growing faster than the schema's size
(6,000 integer properties, 175 KB: ~5 s). Built on the event loop that stalls every client; built
on one thread per ring, one client's big schemas queue everyone else's behind them. So every
build goes through the process's :class:`GrammarPool`, which bounds each request and each key:

- **size**: a constraint whose schema text is over ``max_schema_bytes`` is refused before
  anything is compiled (:class:`GrammarBudgetError`, a 400 naming the limit);
- **time**: a build not done ``compile_budget_s`` after it started is answered with
  :class:`GrammarBudgetError` (a 400 naming the budget). A thread cannot be stopped, so the
  build runs on, holding its worker and its key's share until it ends; it is not cached;
- **workers and queue**: ``workers`` threads, at most ``max_waiting`` builds waiting for one;
  a build that has waited ``queue_timeout_s`` gives up. Both are :class:`GrammarBusyError` (429);
- **per key**: one key (:data:`COMPILE_OWNER`, set by the API to the caller's key) holds at most
  ``per_owner`` builds running or waiting; its next is a 429 naming that share, so a key sending
  big schemas fills only its own share and another key's small schema is built at once.

Built matchers are kept (the last ``cache_entries``) and handed out as copies
(``LLMatcher.deep_copy``, microseconds): the ``n`` choices of a request and a client repeating
its schema build it once. Requests asking for a build already under way wait for it without
taking a slot.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.generation.generator import OverloadedError
from engine.generation.grammar import GrammarError, GrammarMatcher
from engine.generation.request import Constraint, JsonConstraint, ToolCallConstraint

# Who asks for a build (the API sets it to the caller's key name for the request's task; the
# coordinator's stream runs in that task). Unset: one shared "" owner.
COMPILE_OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("deskfleet_compile_owner", default="")

T = TypeVar("T")
_QUEUE_POLL_S = 0.05  # how often a waiter looks whether its queued build has started


class GrammarBudgetError(GrammarError):
    """A constraint is over the grammar budget: its schema text is larger than the size budget,
    or it did not compile within the time budget. The message names the budget; the API answers
    400 (the same schema will be refused again: make it smaller or simpler)."""


class GrammarBusyError(OverloadedError):
    """The grammar workers cannot take a build now: every worker is busy and the waiting queue is
    full, the build waited too long for a worker, or the caller's key already holds its share of
    builds. The API answers 429; retry shortly."""


@dataclass(frozen=True)
class GrammarBudget:
    """The limits of a :class:`GrammarPool` (see the module docstring)."""

    max_schema_bytes: int = 64 * 1024
    compile_budget_s: float = 10.0
    workers: int = 3
    max_waiting: int = 16
    per_owner: int = 2  # below ``workers``: one key never holds every worker
    queue_timeout_s: float = 30.0
    mask_budget_s: float = 2.0  # one stream's masks for one step (applied by the coordinators)
    cache_entries: int = 16

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "workers", "per_owner", "cache_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"GrammarBudget.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"GrammarBudget.max_waiting must not be negative, got {self.max_waiting}")
        for name in ("compile_budget_s", "queue_timeout_s", "mask_budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GrammarBudget.{name} must be positive, got {getattr(self, name)}")


def constraint_bytes(constraint: Constraint) -> int:
    """The size of a constraint's schema text in UTF-8 bytes: the JSON schema, or every tool's
    parameters and name together."""
    if isinstance(constraint, JsonConstraint):
        return len((constraint.schema or "").encode())
    if isinstance(constraint, ToolCallConstraint):
        return sum(len(f.parameters.encode()) + len(f.name.encode()) for f in constraint.functions)
    return 0


def check_constraint_size(constraint: Constraint, budget: GrammarBudget) -> None:
    """GrammarBudgetError when the constraint's schema text is over ``budget.max_schema_bytes``."""
    size = constraint_bytes(constraint)
    if size > budget.max_schema_bytes:
        what = ("response_format.json_schema.schema" if isinstance(constraint, JsonConstraint)
                else "the tools' parameters (together)")
        raise GrammarBudgetError(
            f"{what} is {size:,} bytes, over this server's grammar size budget of {budget.max_schema_bytes:,} bytes; "
            "send a smaller schema")


def timed(work: Callable[..., T], *args: Any) -> tuple[T, float]:
    """(``work(*args)``, the seconds it took): run on a mask thread, the time excludes the wait for it."""
    started = time.monotonic()
    result = work(*args)
    return result, time.monotonic() - started


def check_mask_time(took_s: float) -> None:
    """GrammarBudgetError when one stream's masks for one step took ``took_s``, longer than the
    process's ``mask_budget_s``: such a grammar would slow every step of the ring it shares."""
    budget = grammar_pool().budget.mask_budget_s
    if took_s > budget:
        raise GrammarBudgetError(
            f"the output constraint took {took_s:.2f} s to compute one step's token mask, over this server's "
            f"per-step mask budget of {budget:g} s; send a smaller or simpler schema")


@dataclass
class _Build:
    """One build in the pool: what it builds, its result, who holds a share of it, and when a
    worker took it."""

    key: Hashable
    build: Callable[[], GrammarMatcher]
    owner: str
    submitted: float
    future: concurrent.futures.Future[GrammarMatcher] = field(default_factory=concurrent.futures.Future)
    started: float | None = None
    dropped: bool = False  # its waiters gave up before a worker took it: never run
    overdue: bool = False  # a waiter gave up on it while it ran: not cached when it ends


class GrammarPool:
    """The process's grammar workers (use :func:`grammar_pool`). Thread-safe: coordinators on
    several event loops may share it. Its threads are daemons, started on first use: a build under
    way never holds up the process's exit."""

    def __init__(self, budget: GrammarBudget | None = None):
        self.budget = budget or GrammarBudget()
        self._jobs: queue.SimpleQueue[_Build | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._builds: dict[Hashable, _Build] = {}  # running or waiting, by key
        self._per_owner: collections.Counter[str] = collections.Counter()
        self._cache: collections.OrderedDict[Hashable, GrammarMatcher] = collections.OrderedDict()

    @property
    def pending(self) -> int:
        """Builds running or waiting for a worker."""
        with self._lock:
            return len(self._builds)

    async def async_matcher(self, key: Hashable, build: Callable[[], GrammarMatcher], *,
                            owner: str | None = None) -> GrammarMatcher:
        """A fresh matcher: a copy of the cached one for ``key``, else ``build()`` run on a worker
        (or joined, when one is under way for ``key``). ``owner`` defaults to :data:`COMPILE_OWNER`.

        Raises what ``build`` raises (GrammarError: a 400), GrammarBudgetError past the time budget,
        GrammarBusyError when the pool, its queue or the owner's share is full.
        """
        owner = COMPILE_OWNER.get() if owner is None else owner
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached.fork()
            job = self._builds.get(key)
            if job is None:
                job = self._submit(key, build, owner)
        return (await self._wait(job)).fork()

    def _submit(self, key: Hashable, build: Callable[[], GrammarMatcher], owner: str) -> _Build:
        """Queue a build (the lock held). GrammarBusyError when the owner's share or the pool is full."""
        b = self.budget
        if self._per_owner[owner] >= b.per_owner:
            raise GrammarBusyError(
                f"this API key already has {self._per_owner[owner]} grammars compiling, its share of the grammar "
                f"workers (at most {b.per_owner} at once); retry when they are done")
        if len(self._builds) >= b.workers + b.max_waiting:
            raise GrammarBusyError(
                f"the grammar workers are busy ({b.workers} compiling, {b.max_waiting} waiting, the limit); "
                "retry shortly")
        job = _Build(key, build, owner, time.monotonic())
        self._builds[key] = job
        self._per_owner[owner] += 1
        if len(self._threads) < b.workers:
            thread = threading.Thread(target=self._work, name=f"deskfleet-grammar-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.dropped:
                self._finished(job, None, None)
                continue
            job.started = time.monotonic()
            try:
                result, error = job.build(), None
            except Exception as exc:  # the waiters raise it (GrammarError: the client's 400)
                result, error = None, exc
            self._finished(job, result, error)

    def _finished(self, job: _Build, result: GrammarMatcher | None, error: Exception | None) -> None:
        with self._lock:
            self._builds.pop(job.key, None)
            self._per_owner[job.owner] -= 1
            if self._per_owner[job.owner] <= 0:
                del self._per_owner[job.owner]
            late = job.overdue or (job.started is not None
                                   and time.monotonic() - job.started > self.budget.compile_budget_s)
            if result is not None and not late:
                self._cache[job.key] = result
                while len(self._cache) > self.budget.cache_entries:
                    self._cache.popitem(last=False)
        if result is not None:
            job.future.set_result(result)
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.cancel()

    async def _wait(self, job: _Build) -> GrammarMatcher:
        """The build's matcher, or the budget's error: wait for a worker at most ``queue_timeout_s``,
        then for the build at most ``compile_budget_s`` from its start."""
        b = self.budget
        waiting = asyncio.wrap_future(job.future)
        while True:
            if job.started is None:
                timeout = min(_QUEUE_POLL_S, max(0.0, job.submitted + b.queue_timeout_s - time.monotonic()))
            else:
                timeout = max(0.0, job.started + b.compile_budget_s - time.monotonic())
            done, _ = await asyncio.wait({waiting}, timeout=timeout)
            if done and not waiting.cancelled():
                return waiting.result()
            if job.started is not None and not done and time.monotonic() - job.started >= b.compile_budget_s:
                job.overdue = True
                raise GrammarBudgetError(
                    f"the output constraint did not compile within this server's grammar time budget of "
                    f"{b.compile_budget_s:g} s; send a smaller or simpler schema")
            if done or (job.started is None and time.monotonic() - job.submitted >= b.queue_timeout_s):
                job.dropped = True  # not started: nobody waits for it any more
                raise GrammarBusyError(
                    f"the grammar workers stayed busy for {b.queue_timeout_s:g} s before this request's schema "
                    "could be compiled; retry shortly")

    def close(self) -> None:
        """Stop the workers once the builds queued before are done (they are daemons: nothing waits)."""
        for _ in self._threads:
            self._jobs.put(None)


_POOL: GrammarPool | None = None
_POOL_LOCK = threading.Lock()


def grammar_pool() -> GrammarPool:
    """The process's grammar pool (created on first use with the default budget)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = GrammarPool()
        return _POOL


def use_grammar_budget(budget: GrammarBudget) -> GrammarPool:
    """Replace the process's pool with one of ``budget`` (a server's settings; tests). Builds under
    way in the old pool finish on its threads."""
    global _POOL
    with _POOL_LOCK:
        old, _POOL = _POOL, GrammarPool(budget)
    if old is not None:
        old.close()
    return _POOL
