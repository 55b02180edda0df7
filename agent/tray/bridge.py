"""The agent service on its own asyncio loop, seen from the GUI thread as a QObject with signals.

:class:`AgentService` is asyncio-only and knows nothing of Qt; the tray is Qt-only and must not
block. The bridge runs the service on a :class:`console.shared.loop_thread.LoopThread`, forwards
every status the service reports to the GUI thread (``status_changed``), derives the desktop
notifications from consecutive statuses (``notice``), and turns each menu action into a
coroutine on the loop with a timeout, its outcome delivered back on the GUI thread. ``close()``
stops the service and joins the loop's thread, so quitting leaves no thread behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from agent.service.join_file import async_join_from_file
from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from agent.tray.tray_model import Notice, notices_between
from console.shared.loop_thread import LoopThread
from console.shared.qt_async import QtAsync
from engine.control.messages import AgentStatus
from engine.trust.fleet_ca import Credentials

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # inventory (OpenVINO device query) + mDNS registration
CALL_TIMEOUT_S = 30.0  # pause/resume stop or start a worker
JOIN_TIMEOUT_S = 20.0  # with no address: finding the console (<= 6 s) and the join itself
FIND_CONSOLES_S = 4.0
CLOSE_TIMEOUT_S = 60.0
POLL_INTERVAL_MS = 1000  # fetch progress and steps/s change without the service announcing it

OnResult = Callable[[Any], None] | None
OnError = Callable[[BaseException], None] | None


class AgentBridge(QObject):
    """Create on the GUI thread, ``start()``, then use; ``close()`` before the QApplication ends."""

    status_changed = Signal(object)  # AgentStatus, on the GUI thread
    notice = Signal(object)  # tray_model.Notice
    started = Signal()

    def __init__(self, service: AgentService, *, poll_interval_ms: int = POLL_INTERVAL_MS,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.service = service
        self.loop = LoopThread("deskfleet-agent-loop")
        self.qt_async: QtAsync | None = None
        self.status: AgentStatus | None = None  # the latest, as seen on the GUI thread
        # the fleet API's key from the current assignment, for the chat; kept out of AgentStatus,
        # which the control API serves to other members
        self.api_key: str | None = None
        self.parts: int | None = None  # how many parts (stages) the model this PC helps with has
        self.start_error: BaseException | None = None
        self._start_future: concurrent.futures.Future | None = None
        self._running = False
        self._closed = False
        self._poll = QTimer(self)
        self._poll.setInterval(poll_interval_ms)
        self._poll.timeout.connect(self.poll)

    @property
    def settings(self) -> AgentSettings:
        return self.service.settings

    @property
    def running(self) -> bool:
        """The service started and is not closed: calls into it make sense."""
        return self._running and not self._closed

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, on_started: Callable[[], None] | None = None) -> None:
        """Start the loop thread and the service on it (returns at once; ``started`` follows)."""
        self.loop.start()
        self.qt_async = QtAsync(self.loop, self)
        self.service.subscribe(self._status_from_loop)

        def done(_: object) -> None:
            self._running = True
            self._poll.start()
            self.started.emit()
            if on_started is not None:
                on_started()

        def failed(error: BaseException) -> None:
            self.start_error = error
            if not isinstance(error, asyncio.CancelledError):
                log.error("the agent service did not start: %s", error)
                self.status_changed.emit(None)
                self.notice.emit(Notice("Deskfleet could not start", str(error), "error"))

        self._start_future = self.qt_async.call(self.service.async_start(), timeout=START_TIMEOUT_S,
                                                what="starting the agent", on_result=done, on_error=failed)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the service (its worker and advertisement) and join the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._poll.stop()
        if not self.loop.running:
            return
        if self._start_future is not None and not self._start_future.done():
            self._start_future.cancel()
        try:
            self.loop.run(self.service.async_close(), timeout, what="stopping the agent")
        except Exception as exc:  # still stop the loop: a hung close must not keep the process alive
            log.error("the agent service did not stop cleanly: %s", exc)
        finally:
            self.loop.stop()

    # ---- status from the loop ---------------------------------------------------------------------

    def _status_from_loop(self, status: AgentStatus) -> None:
        """The service's listener: runs on the loop thread, so it only posts."""
        if self.qt_async is not None and not self._closed:
            self.qt_async.post(self._apply_status, status, self._api_key_on_loop(), self._parts_on_loop())

    def _api_key_on_loop(self) -> str | None:
        if self.service.chat_key:  # this PC's own key, from its join; else the one its assignment carries
            return self.service.chat_key
        try:
            assignment = self.service.assignment
        except Exception as exc:  # a damaged stored assignment: the service reports it; the chat goes key-less
            log.debug("no API key from the assignment: %s", exc)
            return None
        return assignment.api_key if assignment is not None else None

    def _parts_on_loop(self) -> int | None:
        """The number of stages of the export this PC's assignment serves (its manifest says)."""
        try:
            assignment = self.service.assignment
            if assignment is None:
                return None
            stages = json.loads(assignment.manifest_json).get("stages")
        except Exception as exc:  # a damaged stored assignment: the service reports it; the tray says "part N"
            log.debug("no stage count from the assignment: %s", exc)
            return None
        return len(stages) if isinstance(stages, list) and stages else None

    def _apply_status(self, status: AgentStatus, api_key: str | None = None, parts: int | None = None) -> None:
        if self._closed:
            return
        self.api_key, self.parts = api_key, parts
        before, self.status = self.status, status
        if status != before:
            self.status_changed.emit(status)
        for notice in notices_between(before, status):
            self.notice.emit(notice)

    def poll(self) -> None:
        """Fetch a fresh status (fetch progress, steps/s) without waiting for the service to announce one."""
        if self.running:
            self._call(self._async_status(), CALL_TIMEOUT_S, "reading the agent's status",
                       lambda result: self._apply_status(*result),
                       lambda error: log.debug("status poll failed: %s", error))

    async def _async_status(self) -> tuple[AgentStatus, str | None, int | None]:
        return self.service.status(), self._api_key_on_loop(), self._parts_on_loop()

    # ---- actions from the GUI ---------------------------------------------------------------------

    def _call(self, coro, timeout: float, what: str, on_result: OnResult = None,
              on_error: OnError = None) -> concurrent.futures.Future | None:
        if not self.running or self.qt_async is None:
            coro.close()
            error = RuntimeError(f"{what}: the agent is not running yet")
            if on_error is not None:
                on_error(error)
            return None

        def report(error: BaseException) -> None:
            if on_error is not None:
                on_error(error)
            elif not isinstance(error, asyncio.CancelledError):
                self.notice.emit(Notice("Deskfleet", f"{what[0].upper()}{what[1:]} failed: {error}", "error"))

        return self.qt_async.call(coro, timeout=timeout, what=what, on_result=on_result, on_error=report)

    def set_manual_pause(self, paused: bool, on_result: OnResult = None, on_error: OnError = None) -> None:
        self._call(self.service.async_set_manual_pause(paused), CALL_TIMEOUT_S,
                   "pausing" if paused else "resuming", on_result, on_error)

    def update_settings(self, on_result: OnResult = None, on_error: OnError = None, **changes: Any) -> None:
        """Change and save settings (``settings.json``); the pause is re-decided at once."""
        self._call(self.service.async_update_settings(**changes), CALL_TIMEOUT_S, "saving the settings",
                   on_result, on_error)

    def join(self, console: str | None, token: str, on_result: Callable[[Credentials], None] | None = None,
             on_error: OnError = None) -> None:
        """Join with ``token`` at ``console`` ("host:port"), or at the console found on the network
        for the token's fleet when ``console`` is None or empty."""
        self._call(self.service.async_join((console or "").strip() or None, token.strip(),
                                           timeout=JOIN_TIMEOUT_S - 2),
                   JOIN_TIMEOUT_S, "joining the fleet", on_result, on_error)

    def join_from_file(self, path: Path, console: str | None, on_result: OnResult = None) -> None:
        """One join with the token file of a silent install (agent.service.join_file); ``on_result``
        gets the outcome ("joined", "refused:<reason>", "unreachable", ...)."""
        self._call(async_join_from_file(self.service, path, console=console, timeout=JOIN_TIMEOUT_S - 2),
                   JOIN_TIMEOUT_S, "joining with the installer's token", on_result)

    def find_consoles(self, on_result: OnResult = None, on_error: OnError = None) -> None:
        """The consoles advertising on the network (a tuple of ConsoleAdvertisement), after a few seconds."""
        self._call(self.service.async_find_consoles(timeout=FIND_CONSOLES_S), FIND_CONSOLES_S + 10,
                   "looking for the console", on_result, on_error)

    def leave(self, on_result: OnResult = None, on_error: OnError = None) -> None:
        self._call(self.service.async_leave(), CALL_TIMEOUT_S, "leaving the fleet", on_result, on_error)
