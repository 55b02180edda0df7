"""The console's headless services on one asyncio loop, seen from the GUI thread as a QObject.

The fleet host (CA, join tokens, enrollment, hub), the mDNS browser and the `FleetModel` live
on a :class:`~console.shared.loop_thread.LoopThread`: they are asyncio objects and not thread-safe.
Their news reaches the GUI thread only through queued signals (``records_changed``,
``hub_event``); every action of a page is a coroutine run on the loop with a timeout, its outcome
delivered back on the GUI thread. The model library is file I/O and stays on the GUI thread, as
its docstring asks. Distribution and the API live in :mod:`console.serving`, on the same loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Collection, Coroutine
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from console.service.agent_record import AgentRecord
from console.service.console_session import ConsoleSession
from console.service.console_settings import ConsoleSettings
from console.service.fleet import FleetModel
from console.service.links import LinkReport, async_measure_links
from console.service.models import ModelEntry, ModelLibrary
from console.service.placement_inputs import PlacementInputs, async_placement_inputs, solve_inputs
from console.shared.loop_thread import LoopThread
from console.shared.qt_async import QtAsync
from engine.control.fleet_services import FleetHost, fleet_host, is_first_run
from engine.control.hub import AgentEvent
from engine.discovery.mdns import Browser
from engine.placement.planner import PlacementRequest, Plan

log = logging.getLogger("deskfleet.console")

START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0
LINKS_TIMEOUT_S = 180.0
PLACE_TIMEOUT_S = 1800.0  # a first placement builds the calibration export and calibrates every device
CLOSE_TIMEOUT_S = 60.0

OnResult = Callable[[Any], None] | None
OnError = Callable[[BaseException], None] | None


class ConsoleBridge(QObject):
    """Create on the GUI thread, ``start()``, then use; ``close()`` before the QApplication ends."""

    started = Signal()
    start_failed = Signal(str)
    records_changed = Signal(object)  # tuple[AgentRecord, ...], on the GUI thread
    hub_event = Signal(object)  # engine.control.hub.AgentEvent
    token_changed = Signal(str)
    error = Signal(str, str)  # (what failed, why) for actions without their own error handler

    def __init__(self, settings: ConsoleSettings, *, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.loop = LoopThread("deskfleet-console-loop")
        self.qt_async: QtAsync | None = None
        self.library = ModelLibrary(settings.state_dir)
        self.first_run = is_first_run(settings.state_dir)  # this start creates the fleet CA
        self.session = ConsoleSession()
        self.host: FleetHost | None = None  # loop objects: touch them only in coroutines
        self.fleet: FleetModel | None = None
        self.records: tuple[AgentRecord, ...] = ()  # the latest, as seen on the GUI thread
        self.token = ""
        self.enrollment = ""
        self.fleet_id = ""
        self._stack = contextlib.AsyncExitStack()
        self._closers: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._running = False
        self._closed = False
        self._refresh = QTimer(self)
        self._refresh.setInterval(int(settings.refresh_s * 1000))
        self._refresh.timeout.connect(self.refresh)

    @property
    def running(self) -> bool:
        return self._running and not self._closed

    def names(self) -> dict[str, str]:
        return {r.node_id: r.name for r in self.records if r.node_id}

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread, the fleet host and discovery (returns at once; ``started`` follows)."""
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        self.loop.start()
        self.qt_async = QtAsync(self.loop, self)

        def done(result: tuple[FleetHost, FleetModel, str]) -> None:
            self.host, self.fleet, token = result
            self.enrollment, self.fleet_id = self.host.enrollment, self.fleet.fleet_id
            self._running = True
            self._set_token(token)
            self._refresh.start()
            self.started.emit()

        def failed(error: BaseException) -> None:
            if not isinstance(error, asyncio.CancelledError):
                log.error("the console did not start: %s", error)
                self.start_failed.emit(str(error))

        self.qt_async.call(self._async_start(), timeout=START_TIMEOUT_S, what="starting the console",
                           on_result=done, on_error=failed)

    async def _async_start(self) -> tuple[FleetHost, FleetModel, str]:
        s = self.settings
        host = await self._stack.enter_async_context(
            fleet_host(s.state_dir, host=s.interface, enrollment_port=s.enrollment_port, hub_port=s.hub_port,
                       advertise_on=s.interface))  # PCs find the console from their join token alone
        fleet = FleetModel(s.state_dir, host.credentials)
        self._stack.callback(fleet.subscribe(self._records_from_loop))
        self._stack.callback(fleet.attach_hub(host.hub))
        self._stack.callback(fleet.attach_api_key(host.rotate_api_key))  # a removal rotates the API key
        self._stack.callback(host.hub.subscribe(self._event_from_loop))
        browser = Browser(s.interface, fleet.update_peers)
        await browser.async_start()
        self._stack.push_async_callback(browser.async_close)
        return host, fleet, host.token()

    def on_close(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``closer()`` on the loop when the console closes, before the fleet host stops."""
        self._closers.append(closer)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop serving, discovery and the fleet host; join the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._refresh.stop()
        if not self.loop.running:
            return
        try:
            self.loop.run(self._async_close(), timeout, what="stopping the console")
        except Exception as exc:  # still stop the loop: a hung close must not keep the process alive
            log.error("the console did not stop cleanly: %s", exc)
        finally:
            self.loop.stop()

    async def _async_close(self) -> None:
        for closer in reversed(self._closers):
            try:
                await closer()
            except Exception:
                log.exception("closing a console service failed")
        await self._stack.aclose()

    # ---- news from the loop ----------------------------------------------------------------------

    def _records_from_loop(self, records: tuple[AgentRecord, ...]) -> None:
        if self.qt_async is not None and not self._closed:
            self.qt_async.post(self._apply_records, records)

    def _apply_records(self, records: tuple[AgentRecord, ...]) -> None:
        if not self._closed:
            self.records = records
            self.records_changed.emit(records)

    def _event_from_loop(self, event: AgentEvent) -> None:
        if self.qt_async is not None and not self._closed:
            self.qt_async.post(lambda: None if self._closed else self.hub_event.emit(event))

    def _set_token(self, token: str) -> None:
        self.token = token
        self.token_changed.emit(token)

    # ---- calls into the loop ---------------------------------------------------------------------

    def call(self, coro: Coroutine[Any, Any, Any], what: str, *, timeout: float = CALL_TIMEOUT_S,
             on_result: OnResult = None, on_error: OnError = None) -> concurrent.futures.Future | None:
        """Run ``coro`` on the loop; ``on_result``/``on_error`` on the GUI thread. Without
        ``on_error`` a failure is reported through ``error``."""
        if not self.running or self.qt_async is None:
            coro.close()
            if on_error is not None:
                on_error(RuntimeError(f"{what}: the console is not running"))
            return None

        def report(exc: BaseException) -> None:
            if on_error is not None:
                on_error(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                self.error.emit(what, str(exc))

        return self.qt_async.call(coro, timeout=timeout, what=what, on_result=on_result, on_error=report)

    def _on_loop(self, fn: Callable[[], Any], what: str, on_result: OnResult, on_error: OnError) -> None:
        async def run() -> Any:
            return fn()

        self.call(run(), what, on_result=on_result, on_error=on_error)

    # ---- fleet actions ---------------------------------------------------------------------------

    def new_token(self) -> None:
        self._on_loop(lambda: self.host.token(), "issuing a join token", self._set_token, None)

    def issue_token_now(self) -> str:
        """A new join token, waited for on the GUI thread (the token book lives on the loop; this
        takes milliseconds). For widgets that need the token at once, like the first-run view."""
        async def issue() -> str:
            return self.host.token()

        token = self.loop.run(issue(), CALL_TIMEOUT_S, "issuing a join token")
        self._set_token(token)
        return token

    def approve(self, key: str, on_result: OnResult = None, on_error: OnError = None) -> None:
        self._on_loop(lambda: self.fleet.approve(key), "approving the agent", on_result, on_error)

    def remove(self, key: str, on_result: OnResult = None, on_error: OnError = None) -> None:
        self._on_loop(lambda: self.fleet.remove(key), "removing the agent", on_result, on_error)

    def pause(self, key: str, on_result: OnResult = None, on_error: OnError = None) -> None:
        self.call(self.fleet.async_pause(key), "pausing the agent", on_result=on_result, on_error=on_error)

    def resume(self, key: str, on_result: OnResult = None, on_error: OnError = None) -> None:
        self.call(self.fleet.async_resume(key), "resuming the agent", on_result=on_result, on_error=on_error)

    def add_address(self, host: str, port: int, on_result: OnResult = None, on_error: OnError = None) -> None:
        self.call(self.fleet.async_add_address(host, port), f"adding {host}:{port}",
                  on_result=on_result, on_error=on_error)

    def refresh(self) -> None:
        """Poll every member agent's status (state, memory, reachability)."""
        if self.running:
            self.call(self.fleet.async_refresh(), "refreshing the agents",
                      on_error=lambda exc: log.debug("refresh failed: %s", exc))

    def measure_links(self, node_ids: Collection[str], on_result: Callable[[LinkReport], None],
                      on_error: OnError = None) -> None:
        self.call(async_measure_links(self.fleet, list(node_ids)), "measuring the links",
                  timeout=LINKS_TIMEOUT_S, on_result=on_result, on_error=on_error)

    # ---- placement -------------------------------------------------------------------------------

    def place(self, model: ModelEntry, request: PlacementRequest, context: int, leave_out: Collection[str],
              on_result: Callable[[tuple[PlacementInputs, Plan]], None], on_error: OnError) -> None:
        """Measure, calibrate (cached) and solve for ``model`` in the session's export format."""
        spec, steps = self.session.spec, self.settings.calibration_steps

        async def place() -> tuple[PlacementInputs, Plan]:
            from export.exporter import ExportOptions

            checkpoint = await asyncio.to_thread(_checkpoint_of, model)
            inputs = await async_placement_inputs(
                self.fleet, self.host.hub, checkpoint, options=ExportOptions(**spec.options_kwargs()),
                context=context, streams=request.n_streams, allow_battery=request.allow_battery, steps=steps,
                threads=self.settings.worker.threads)  # time the devices as the workers will run them
            return inputs, await asyncio.to_thread(solve_inputs, inputs, request, frozenset(leave_out))

        self.call(place(), f"placing {model.name}", timeout=PLACE_TIMEOUT_S, on_result=on_result,
                  on_error=on_error)

    def solve(self, inputs: PlacementInputs, request: PlacementRequest, leave_out: Collection[str],
              on_result: Callable[[Plan], None], on_error: OnError) -> None:
        """Re-solve over inputs already measured (the solver runs off the loop)."""
        self.call(asyncio.to_thread(solve_inputs, inputs, request, frozenset(leave_out)), "solving the placement",
                  timeout=request.time_limit_s + 30, on_result=on_result, on_error=on_error)


def _checkpoint_of(model: ModelEntry) -> Path:
    """The HF checkpoint directory behind a model (a GGUF is converted once, then cached)."""
    if model.kind == "hf" and model.path is not None:
        return model.path
    from export.sources import resolve_model

    return resolve_model(model.spec).checkpoint_dir
