"""The enrolment audit: one JSON line per PC admitted, approved or auto-approved, naming the token.

A line::

    {"time": "2026-12-02T18:30:01.123Z", "event": "admitted", "token_id": "3fa9c01b2e",
     "token_label": "floor 3", "node_id": "9c1e...", "name": "pc-17", "remote": "10.0.0.17"}

``event`` is ``admitted`` (the enrolment endpoint signed the PC's certificate for a valid token),
``refused`` (a join with a token the book knows but that admits no PC now: revoked, used up or
expired, so a leaked token's use shows; ``reason`` says which, ``node_id`` is empty; tokens the book
does not know are strangers', logged only, so they cannot grow this file),
``auto_approved`` (the PC was approved because the token that admitted it is marked so) or
``approved`` / ``removed`` (by the admin; ``token_id`` then names the token that admitted it, if
the book still remembers it). The file (``enrolment-audit.jsonl`` in the console's state dir,
0600) only grows by appends; an office's joins are a few hundred lines a year. A write that fails
is logged and the join still answered: the audit must not stop a roll-out.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("deskfleet.enrolment")

AUDIT_FILE = "enrolment-audit.jsonl"
EVENTS = ("admitted", "auto_approved", "approved", "removed", "refused")


def _stamp(epoch_s: float) -> str:
    moment = datetime.datetime.fromtimestamp(epoch_s, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JoinAudit:
    """Appends enrolment events to ``path`` (see the module docstring); thread-safe."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._failed = False

    @classmethod
    def in_dir(cls, state_dir: str | os.PathLike[str]) -> JoinAudit:
        return cls(Path(state_dir) / AUDIT_FILE)

    def write(self, event: str, *, node_id: str, name: str, token_id: str | None = None,
              token_label: str | None = None, **extra: Any) -> None:
        """Append one line; also logged at INFO, so the service's log tells the same story."""
        if event not in EVENTS:
            raise ValueError(f"unknown enrolment audit event {event!r}; one of {', '.join(EVENTS)}")
        line = {"time": _stamp(time.time()), "event": event, "token_id": token_id,
                "token_label": token_label, "node_id": node_id, "name": name, **extra}
        log.info("%s: PC %s (node %s) by token %s%s", event, name, node_id[:16], token_id or "-",
                 f" ({token_label})" if token_label else "")
        data = (json.dumps(line, separators=(",", ":"), ensure_ascii=True) + "\n").encode("ascii")
        with self._lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                self._failed = False
            except OSError as exc:
                if not self._failed:
                    log.error("cannot write the enrolment audit %s (%s); joins go on, unaudited", self.path, exc)
                self._failed = True

    def lines(self) -> list[dict[str, Any]]:
        """Every line so far (for the admin API and tests); a damaged line is skipped and logged."""
        try:
            raw = self.path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return []
        out = []
        for number, text in enumerate(raw.splitlines(), 1):
            try:
                doc = json.loads(text)
            except ValueError:
                log.warning("line %d of %s is not JSON; skipped", number, self.path)
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out
