"""The API's audit log: one JSON line per request — who asked, when, for what, how much — never the text.

A line (:class:`AuditRecord`)::

    {"time": "2026-12-02T05:30:01.123Z", "key": "alice", "method": "POST", "path": "/v1/chat/completions",
     "model": "qwen2.5-0.5b", "ring": "r1", "status": 200, "prompt_tokens": 31, "completion_tokens": 12,
     "duration_ms": 840.2, "remote": "10.0.0.7"}

``key`` is the key's name (``null`` when the request carried no valid key: a refused stranger is
logged too), ``ring`` the ring that served it (``null`` when none did). Prompts, messages and
answers are never passed to this module. ``/health`` is not logged (liveness probes would fill
it). The file (``audit.jsonl``, 0600) is rotated by size: past ``max_bytes`` it becomes
``audit.jsonl.1`` (the older ones shift up to ``keep``, the oldest is dropped). A write that fails
(disk full) is logged once and the request still answered: the log must not take the API down.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("deskfleet.audit")

AUDIT_FILE = "audit.jsonl"
DEFAULT_MAX_BYTES = 16 << 20
DEFAULT_KEEP = 5


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


def utc_stamp(epoch_s: float) -> str:
    """ISO 8601 UTC with milliseconds and a ``Z``."""
    moment = datetime.datetime.fromtimestamp(epoch_s, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AuditLog:
    """Appends :class:`AuditRecord` lines to ``path``, rotating by size. Thread-safe."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                 keep: int = DEFAULT_KEEP) -> None:
        if max_bytes < 1 or keep < 1:
            raise ValueError(f"AuditLog needs max_bytes >= 1 and keep >= 1, got {max_bytes}, {keep}")
        self.path = Path(path)
        self.max_bytes, self.keep = max_bytes, keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._failing = False

    @classmethod
    def in_dir(cls, state_dir: str | os.PathLike[str], **kw: int) -> AuditLog:
        return cls(Path(state_dir) / AUDIT_FILE, **kw)

    def write(self, record: AuditRecord) -> None:
        data = record.line().encode("ascii")
        with self._lock:
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
        with self._lock:
            self._close()
