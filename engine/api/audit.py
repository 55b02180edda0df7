"""The API's audit log: one JSON line per request — who asked, when, for what, how much — never the text.

A line (:class:`AuditRecord`)::

    {"time": "2026-12-02T05:30:01.123Z", "key": "alice", "method": "POST", "path": "/v1/chat/completions",
     "model": "qwen2.5-0.5b", "ring": "r1", "status": 200, "prompt_tokens": 31, "completion_tokens": 12,
     "duration_ms": 840.2, "remote": "10.0.0.7"}

``key`` is the key's name, ``ring`` the ring that served it (``null`` when none did). Prompts,
messages and answers are never passed to this module. ``/health`` is not logged (liveness probes
would fill it).

Requests without a valid key (strangers: 401, 421) are not written line by line — anyone who can
reach the port could then rotate every authenticated line out of the file within minutes. They
are counted per remote address and status (:class:`StrangerTally`), and one summary line
(:class:`StrangerSummary`, ``"kind": "strangers"``) per :data:`STRANGER_INTERVAL_S` names the
:data:`STRANGER_ADDRESSES` busiest addresses and sums the rest; it is written with the first
audit write after its minute ends, or when the log is closed::

    {"time": "2026-12-02T05:30:00.000Z", "kind": "strangers", "key": null, "interval_s": 60.0,
     "refused": [{"remote": "10.0.0.9", "status": 401, "requests": 64712}], "other_addresses": 0,
     "other_requests": 0}
 The file (``audit.jsonl``, 0600) is rotated by size: past ``max_bytes`` it becomes
``audit.jsonl.1`` (the older ones shift up to ``keep``, the oldest is dropped). A write that fails
(disk full) is logged once and the request still answered: the log must not take the API down.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("deskfleet.audit")

AUDIT_FILE = "audit.jsonl"
DEFAULT_MAX_BYTES = 16 << 20
DEFAULT_KEEP = 5
STRANGER_INTERVAL_S = 60.0
STRANGER_ADDRESSES = 32  # (address, status) pairs named in one summary line; the rest are summed
STRANGER_TABLE = 4096  # pairs counted apart in one interval; beyond, a new pair goes to the sum at once


@dataclass(frozen=True)
class AuditRecord:
    """One request, as the audit keeps it (see the module docstring)."""

    time: str
    key: str | None
    method: str
    path: str
    model: str | None
    ring: str | None
    status: int
    prompt_tokens: int
    completion_tokens: int
    duration_ms: float
    remote: str | None

    def line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=True) + "\n"


@dataclass(frozen=True)
class StrangerSummary:
    """The strangers refused in one interval from ``started`` (epoch s): ``refused`` as (remote,
    status, requests), most requests first; the pairs beyond those, summed."""

    started: float
    interval_s: float
    refused: tuple[tuple[str | None, int, int], ...]
    other_addresses: int
    other_requests: int

    def line(self) -> str:
        doc = {"time": utc_stamp(self.started), "kind": "strangers", "key": None, "interval_s": self.interval_s,
               "refused": [{"remote": r, "status": s, "requests": n} for r, s, n in self.refused],
               "other_addresses": self.other_addresses, "other_requests": self.other_requests}
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=True) + "\n"


class StrangerTally:
    """Counts of refused strangers per (remote address, status) over one interval at a time. Pure
    (times are passed in); bounded: at most ``table`` pairs are counted apart in an interval."""

    def __init__(self, interval_s: float = STRANGER_INTERVAL_S, named: int = STRANGER_ADDRESSES,
                 table: int = STRANGER_TABLE) -> None:
        self.interval_s, self.named, self.table = interval_s, named, table
        self._counts: Counter[tuple[str | None, int]] = Counter()
        self._overflow_pairs = 0
        self._overflow_requests = 0
        self._started: float | None = None

    def due(self, now: float) -> bool:
        """True when the interval being counted has ended (its summary should be written)."""
        return self._started is not None and now >= self._started + self.interval_s

    def count(self, remote: str | None, status: int, now: float) -> None:
        if self._started is None:
            self._started = now
        pair = (remote[:64] if remote else remote, status)
        if pair in self._counts or len(self._counts) < self.table:
            self._counts[pair] += 1
        else:
            self._overflow_pairs += 1  # an upper bound: a pair seen twice past the table counts twice
            self._overflow_requests += 1

    def take(self) -> StrangerSummary | None:
        """The summary of what was counted (None if nothing was), and a fresh interval."""
        if self._started is None:
            return None
        ranked = self._counts.most_common()
        named, rest = ranked[:self.named], ranked[self.named:]
        summary = StrangerSummary(self._started, self.interval_s, tuple((r, s, n) for (r, s), n in named),
                                  len(rest) + self._overflow_pairs,
                                  sum(n for _, n in rest) + self._overflow_requests)
        self._counts.clear()
        self._overflow_pairs = self._overflow_requests = 0
        self._started = None
        return summary


def utc_stamp(epoch_s: float) -> str:
    """ISO 8601 UTC with milliseconds and a ``Z``."""
    moment = datetime.datetime.fromtimestamp(epoch_s, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AuditLog:
    """Appends :class:`AuditRecord` lines to ``path``, and a :class:`StrangerSummary` a minute for
    the strangers :meth:`refused`, rotating by size. Thread-safe."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                 keep: int = DEFAULT_KEEP, stranger_interval_s: float = STRANGER_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if max_bytes < 1 or keep < 1:
            raise ValueError(f"AuditLog needs max_bytes >= 1 and keep >= 1, got {max_bytes}, {keep}")
        self.path = Path(path)
        self.max_bytes, self.keep = max_bytes, keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._failing = False
        self._clock = clock
        self._strangers = StrangerTally(stranger_interval_s)

    @classmethod
    def in_dir(cls, state_dir: str | os.PathLike[str], **kw: Any) -> AuditLog:
        return cls(Path(state_dir) / AUDIT_FILE, **kw)

    def write(self, record: AuditRecord) -> None:
        with self._lock:
            self._summarise_if_due()
            self._append(record.line())

    def refused(self, remote: str | None, status: int) -> None:
        """Count a stranger's request (no valid key) refused with ``status``: summarised, not a line."""
        with self._lock:
            self._summarise_if_due()
            self._strangers.count(remote, status, self._clock())

    def _summarise_if_due(self) -> None:
        if self._strangers.due(self._clock()):
            summary = self._strangers.take()
            if summary is not None:
                self._append(summary.line())

    def _append(self, line: str) -> None:
        """One line, rotating first when it would not fit (the caller holds the lock)."""
        data = line.encode("ascii")
        try:
            if self._fd is None:
                self._open()
            elif self._size + len(data) > self.max_bytes and self._size > 0:
                self._rotate()
            assert self._fd is not None
            os.write(self._fd, data)
            self._size += len(data)
            self._failing = False
        except OSError as exc:
            if not self._failing:
                log.error("cannot write the audit log %s (%s); requests are answered but not audited "
                          "until it can be written", self.path, exc)
            self._failing = True
            self._close()

    def _open(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o600)
        self._size = os.fstat(self._fd).st_size
        if self._size >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        self._close()
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.path.exists():
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL
                           | getattr(os, "O_BINARY", 0), 0o600)
        self._size = 0

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def close(self) -> None:
        """Write the strangers counted so far, and close the file."""
        with self._lock:
            summary = self._strangers.take()
            if summary is not None:
                self._append(summary.line())
            self._close()
