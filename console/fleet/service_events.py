"""The fleet service's news for its admin clients: a numbered event feed read by long-poll, and
the jobs long actions run as (docs/ADMIN_API.md, "Jobs" and "Event feed").

Both live on the service's loop. The feed keeps the last ``keep`` events; a client asks for those
after the last ``seq`` it saw and waits (bounded) when there are none. A client starting out
(``after`` 0) or one that fell behind the kept window gets a snapshot first — events the service
makes from its current state — so any number of clients converge on the same picture.

One answer is a page: at most ``limit`` events (:data:`PAGE_EVENTS` unless the client asks for
fewer) and about :data:`MAX_PAGE_BYTES` of JSON (:meth:`Poll.render`; always at least one event).
A client that got ``more`` asks again at once with ``next``; nothing is skipped. So a poll's
answer never grows with the feed, and the loop never serialises the whole feed in one go.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from console.fleet_api.errors import FleetServiceError
from console.fleet_api.feed import EventKind
from engine.tasks import start_task

log = logging.getLogger("deskfleet.fleet")

KEEP_EVENTS = 1000
MAX_WAIT_S = 60.0
KEEP_JOBS_S = 600.0
PAGE_EVENTS = 200  # events one poll answers at most
MAX_PAGE_BYTES = 4 << 20  # JSON one poll answers with, about (the first event always goes)


@dataclass(frozen=True)
class Event:
    seq: int
    at: float
    kind: EventKind
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "at": self.at, "kind": self.kind, "data": self.data}


@dataclass(frozen=True)
class Poll:
    """One answer of the feed: ``events`` in order, ``next`` to ask after, ``reset`` when the
    client's ``after`` had fallen out of the kept window (its state is stale: re-read it), ``more``
    when newer events wait beyond this page (ask again with ``next`` at once)."""

    events: tuple[Event, ...]
    next: int
    reset: bool = False
    more: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"events": [e.to_json() for e in self.events], "next": self.next, "reset": self.reset,
                "more": self.more}

    def render(self, max_bytes: int = MAX_PAGE_BYTES) -> bytes:
        """The answer as JSON bytes, cut after the event that reaches ``max_bytes`` (``next`` and
        ``more`` then say where the client resumes). A snapshot (``reset`` or a start) goes whole:
        its events share one ``seq`` and cannot be resumed part-way."""
        parts: list[bytes] = []
        size, next_seq, more = 0, self.next, self.more
        pageable = not self.reset and len({e.seq for e in self.events}) == len(self.events)
        for i, event in enumerate(self.events):
            part = json.dumps(event.to_json(), separators=(",", ":")).encode()
            parts.append(part)
            size += len(part) + 1
            if pageable and size >= max_bytes and i + 1 < len(self.events):
                next_seq, more = event.seq, True
                break
        head = {"next": next_seq, "reset": self.reset, "more": more}
        return b'{"events":[' + b",".join(parts) + b"]," + json.dumps(head, separators=(",", ":")).encode()[1:]


class EventFeed:
    """``publish(kind, data)`` from the loop; ``await poll(after, timeout)`` from a request handler.
    ``snapshot()`` gives (kind, data) pairs for the current state, sent to a client starting out."""

    def __init__(self, snapshot: Callable[[], Sequence[tuple[EventKind, dict[str, Any]]]] = tuple,
                 keep: int = KEEP_EVENTS, *, latest_only: Collection[EventKind] = ()) -> None:
        self._snapshot = snapshot
        self._events: collections.deque[Event] = collections.deque(maxlen=keep)
        self._seq = 1  # a snapshot answers next >= 1, so "after=0" only ever means a client starting out
        # kinds whose every event is the whole state (the agents' records): only the newest is kept, so
        # a thousand of them (~1.5 MB each at 1,000 agents) never fill the memory or push others out
        self._latest_only = frozenset(latest_only)
        self._evicted = 0  # the newest seq pushed out by ``keep``: a client that saw less must reset
        self._changed = asyncio.Event()

    @property
    def last_seq(self) -> int:
        return self._seq

    def publish(self, kind: EventKind, data: dict[str, Any]) -> Event:
        self._seq += 1
        event = Event(self._seq, time.time(), kind, data)
        if kind in self._latest_only:
            superseded = [e for e in self._events if e.kind == kind]
            for old in superseded:
                self._events.remove(old)
        if len(self._events) == self._events.maxlen:
            self._evicted = self._events[0].seq
        self._events.append(event)
        self._changed.set()
        self._changed = asyncio.Event()  # the next waiters wait for the next event
        return event

    def since(self, after: int, limit: int = PAGE_EVENTS) -> Poll:
        """What a client that saw ``after`` gets now (without waiting): at most ``limit`` events."""
        oldest = self._evicted + 1 if self._events or self._evicted else self._seq + 1
        if after <= 0 or after > self._seq or after < oldest - 1:
            reset = after > 0
            snap = tuple(Event(self._seq, time.time(), kind, data) for kind, data in self._snapshot())
            return Poll(snap, self._seq, reset)
        newer = tuple(itertools.islice((e for e in self._events if e.seq > after), max(1, limit) + 1))
        if len(newer) > max(1, limit):
            newer = newer[:-1]
            return Poll(newer, newer[-1].seq, more=True)
        return Poll(newer, self._seq)

    async def poll(self, after: int, timeout: float, limit: int = PAGE_EVENTS) -> Poll:
        """Events after ``after`` (at most ``limit``); waits up to ``timeout`` s (at most MAX_WAIT_S)
        for one when there are none."""
        answer = self.since(after, limit)
        if answer.events or answer.reset or after <= 0:
            return answer
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), max(0.0, min(timeout, MAX_WAIT_S)))
        return self.since(after, limit)


class JobNotFoundError(FleetServiceError):
    """No job of that id (never started, or finished more than KEEP_JOBS_S ago)."""


@dataclass
class Job:
    id: str
    kind: str
    ring: str | None
    started: float
    state: str = "running"  # running, done, failed, cancelled
    ended: float | None = None
    result: Any = None
    error: str | None = None
    task: asyncio.Task | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "ring": self.ring, "state": self.state, "started": self.started,
                "ended": self.ended, "result": self.result, "error": self.error}


class Jobs:
    """Long actions as tasks with an id; each start and end is published on the feed (``job``)."""

    def __init__(self, feed: EventFeed) -> None:
        self.feed = feed
        self._jobs: dict[str, Job] = {}
        self._ids = itertools.count(1)

    def start(self, kind: str, work: Coroutine[Any, Any, Any], *, ring: str | None = None,
              to_json: Callable[[Any], Any] = lambda r: r) -> Job:
        """Run ``work`` as a job; its result (through ``to_json``) or its error becomes the job's."""
        self._forget_old()
        job = Job(f"j{next(self._ids)}", kind, ring, time.time())
        self._jobs[job.id] = job

        async def run() -> None:
            try:
                job.result = to_json(await work)
                job.state = "done"
            except asyncio.CancelledError:
                job.state, job.error = "cancelled", "cancelled by an admin"
            except Exception as exc:
                job.state, job.error = "failed", str(exc) or type(exc).__name__
                if not isinstance(exc, FleetServiceError | OSError) and not _named(exc):
                    log.exception("job %s (%s) failed", job.id, kind)
            finally:
                job.ended = time.time()
                self.feed.publish(EventKind.JOB, {"job": job.to_json()})

        job.task = start_task(run(), name=f"deskfleet-job-{job.id}", logger=log)
        self.feed.publish(EventKind.JOB, {"job": job.to_json()})
        return job

    def get(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"there is no job {job_id!r} (finished jobs are kept {KEEP_JOBS_S:.0f} s)")
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.task is not None and not job.task.done():
            job.task.cancel()
        return job

    async def async_close(self) -> None:
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _forget_old(self) -> None:
        now = time.time()
        for job_id in [j.id for j in self._jobs.values() if j.ended is not None and now - j.ended > KEEP_JOBS_S]:
            del self._jobs[job_id]


def _named(exc: BaseException) -> bool:
    from engine.errors import DeskfleetError

    return isinstance(exc, DeskfleetError)
