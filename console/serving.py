"""From a plan to a served model: export (or reuse) with the plan's split, distribute the shards,
bring the ring up under a coordinator, put the OpenAI API on it, and sample its metrics.

The export job is a background process polled by a GUI-thread timer (the model library is a GUI
thread object); the `Distributor`, the coordinator and the API server are asyncio objects on the
console's loop, reached through :class:`console.bridge.ConsoleBridge`. Everything they report
arrives here as queued signals. A failed distribution keeps its `Distributor`, so "Re-run"
resumes it (agents keep their verified files); distributing another plan closes the old ring.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import socket

from PySide6.QtCore import QObject, QTimer, Signal

from console.bridge import ConsoleBridge
from console.service.console_session import Serving
from console.service.console_settings import free_port, ring_endpoints
from console.service.distribution import Distributor
from console.service.errors import ConsoleError
from console.service.export_catalog import ExportInfo
from console.service.export_job import ExportEvent, ExportFailed, ExportFinished, ExportJob
from console.service.ring_layout import AgentEndpoint, AgentProgress, RingHealth, RingLayout
from engine.api.server import RunningApi, async_run_api
from engine.generation.tokenizer import ChatTokenizer
from engine.placement.planner import Plan

log = logging.getLogger("deskfleet.console")

EXPORT_POLL_MS = 100
RUN_TIMEOUT_S = 3600.0  # fetches are bounded by the distributor's own phase timeouts


class FleetServing(QObject):
    """``distribute(plan)``; ``rerun()`` after a failure; ``stop()``. Signals on the GUI thread."""

    export_event = Signal(object)  # console.service.export_job.ExportEvent
    progress = Signal(object)  # AgentProgress
    health = Signal(object)  # RingHealth, after a run succeeded
    failed = Signal(str)  # a run failed; "Re-run" resumes it
    phase_changed = Signal(str)  # idle, exporting, distributing, serving, failed, stopping
    api_ready = Signal(str)  # the API's base URL
    metrics = Signal(object)  # dict from Coordinator.metrics()

    def __init__(self, bridge: ConsoleBridge, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.phase = "idle"
        self.job: ExportJob | None = None
        self.api_url: str | None = None
        self.api_key: str | None = None  # what the API requires (the console's, from the keyring)
        self._dist: Distributor | None = None  # a loop object
        self._standby: tuple[AgentEndpoint, ...] = ()
        self._api: RunningApi | None = None  # a loop object
        self._unsubscribe_key = None  # from FleetHost.subscribe_api_key, once serving
        self._plan: Plan | None = None
        self._export: ExportInfo | None = None
        self._api_port = bridge.settings.api_port
        self._job_timer = QTimer(self)
        self._job_timer.setInterval(EXPORT_POLL_MS)
        self._job_timer.timeout.connect(self._poll_job)
        self._metrics_timer = QTimer(self)
        self._metrics_timer.setInterval(int(bridge.settings.metrics_s * 1000))
        self._metrics_timer.timeout.connect(self._sample_metrics)
        bridge.on_close(self._async_close)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_changed.emit(phase)

    @property
    def can_rerun(self) -> bool:
        return self.phase == "failed" and self._plan is not None

    # ---- actions (GUI thread) --------------------------------------------------------------------

    def distribute(self, plan: Plan) -> None:
        """Export the session's model with ``plan``'s split (an identical export is reused), then
        bring it up on the plan's agents."""
        session = self.bridge.session
        if session.model is None:
            self._fail("choose a model on the Models page first")
            return
        if self.phase in ("exporting", "distributing", "stopping"):
            return
        self._plan = plan
        self._set_phase("exporting")
        try:
            self.job = self.bridge.library.start_export(session.model, plan=plan, spec=session.spec,
                                                        on_event=self._on_export_event)
        except ConsoleError as exc:
            self._fail(str(exc))
            return
        self._job_timer.start()

    def cancel_export(self) -> None:
        if self.job is not None and not self.job.done:
            self.job.cancel()

    def rerun(self) -> None:
        """Resume a failed distribution (the same export and ring)."""
        if not self.can_rerun:
            return
        if self._export is None or self._dist is None:
            self.distribute(self._plan)
            return
        self._set_phase("distributing")
        self.bridge.call(self._async_run(None), "distributing", timeout=RUN_TIMEOUT_S,
                         on_result=self._served, on_error=self._run_failed)

    def stop(self) -> None:
        """Stop serving: the API, the coordinator and every agent's worker."""
        self.cancel_export()
        self._metrics_timer.stop()
        self._set_phase("stopping")
        self.bridge.call(self._async_close(), "stopping the fleet", timeout=120,
                         on_result=lambda _: self._stopped(), on_error=lambda exc: self._stopped())

    def _stopped(self) -> None:
        self.api_url = None
        self.bridge.session.set_serving(None)
        self._set_phase("idle")

    # ---- export ----------------------------------------------------------------------------------

    def _poll_job(self) -> None:
        if self.job is None or self.job.done:
            self._job_timer.stop()
            return
        self.job.poll()

    def _on_export_event(self, event: ExportEvent) -> None:
        self.export_event.emit(event)
        if isinstance(event, ExportFinished):
            self._job_timer.stop()
            self._export = event.export
            self._bring_up(event.export)
        elif isinstance(event, ExportFailed):
            self._job_timer.stop()
            self._fail(f"the export failed: {event.message}")
        elif self.job is not None and self.job.state == "cancelled":
            self._job_timer.stop()
            self._fail("the export was cancelled; nothing was distributed")

    # ---- distribution (the coroutines run on the loop) -------------------------------------------

    def _bring_up(self, export: ExportInfo) -> None:
        plan, settings = self._plan, self.bridge.settings
        records = {r.node_id: r for r in self.bridge.records if r.node_id}
        try:
            endpoints = ring_endpoints(plan, records, settings.data_port)
            layout = RingLayout.from_plan(plan, endpoints)
        except ConsoleError as exc:
            self._fail(str(exc))
            return
        # every other approved agent stands by: a stage whose PC is paused or lost moves there
        # (data ports as ring_endpoints gives them: one more per agent sharing an address)
        per_address = collections.Counter(ep.control.rpartition(":")[0] for ep in endpoints.values())
        standby = []
        for r in records.values():
            if r.approved and r.node_id not in endpoints:
                index, per_address[r.address] = per_address[r.address], per_address[r.address] + 1
                port = free_port(r.address) if settings.data_port == 0 else settings.data_port + index
                standby.append(AgentEndpoint(r.control_address, port, r.name, r.node_id))
        self._standby = tuple(standby)
        if self._api_port == 0:  # agents learn the API's address with their assignment
            self._api_port = free_port(settings.interface)
        self._set_phase("distributing")
        self.bridge.call(self._async_run(layout, export), "distributing", timeout=RUN_TIMEOUT_S,
                         on_result=self._served, on_error=self._run_failed)

    async def _async_run(self, layout: RingLayout | None, export: ExportInfo | None = None) -> tuple[RingHealth, str]:
        if layout is not None:  # a new ring: the old one goes first
            await self._async_close()
            settings = self.bridge.settings
            self._dist = Distributor(
                self.bridge.host, export.path, layout, export_id=export.export_id, console_host=settings.interface,
                worker=settings.worker, api_url=f"http://{settings.interface}:{self._api_port}/v1",
                on_progress=self._progress_from_loop, standby=self._standby, runtime=settings.runtime)
        if self._api is not None:  # the coordinator may be rebuilt: the API follows it
            await self._api.async_stop()
            self._api = None
        health = await self._dist.async_run()
        tokenizer = await asyncio.to_thread(ChatTokenizer, self._dist.tokenizer_dir)
        settings = self.api_settings()
        self._api = await async_run_api(self._dist.coordinator, tokenizer, settings,  # tray keys: the host's book
                                        self.bridge.settings.interface, self._api_port, keys=self.bridge.host.keys)
        if self._unsubscribe_key is None:
            self._unsubscribe_key = self.bridge.host.subscribe_api_key(self._api_key_rotated)
        return health, self._api.url

    def _api_key_rotated(self, key: str) -> None:
        """On the loop: a removal rotated the console's key. The running API takes it at once;
        the chat page is told through ``api_ready`` (it re-opens its client on a changed key)."""
        if self._api is not None:
            self._api.set_api_key(key)
        if self.bridge.qt_async is not None:
            self.bridge.qt_async.post(self._take_key, key)

    def _take_key(self, key: str) -> None:  # GUI thread
        self.api_key = key
        if self.api_url is not None and self.phase == "serving":
            self.api_ready.emit(self.api_url)  # the chat page re-opens its client with the new key

    def api_settings(self):
        """The API's settings: the console's key always (from the command line, else the keyring's;
        the keyring's once a removal rotated it), and this PC's name among the host names clients may address it by."""
        base = self.bridge.settings.api
        key = self.bridge.host.api_key if self.bridge.host.key_rotated else (base.api_key or self.bridge.host.api_key)
        return dataclasses.replace(base, api_key=key,
                                   allowed_hosts=(*base.allowed_hosts, socket.gethostname()))

    def _progress_from_loop(self, progress: AgentProgress) -> None:
        if self.bridge.qt_async is not None:
            self.bridge.qt_async.post(self.progress.emit, progress)

    def _served(self, result: tuple[RingHealth, str]) -> None:
        health, url = result
        self.api_url = url
        self.api_key = self.api_settings().api_key
        self.health.emit(health)
        self.bridge.session.set_serving(Serving(self._plan, self._export.export_id, health.local_stage0, url))
        self._set_phase("serving")
        self.api_ready.emit(url)
        self._metrics_timer.start()

    def _run_failed(self, exc: BaseException) -> None:
        self._fail(str(exc) if not isinstance(exc, asyncio.CancelledError) else "the distribution was cancelled")

    def _fail(self, message: str) -> None:
        log.warning("distribution: %s", message)
        self._set_phase("failed")
        self.failed.emit(message)

    async def _async_close(self) -> None:
        if self._unsubscribe_key is not None:
            self._unsubscribe_key()
            self._unsubscribe_key = None
        api, self._api = self._api, None
        dist, self._dist = self._dist, None
        if api is not None:
            await api.async_stop()
        if dist is not None:
            await dist.async_close()

    # ---- metrics ---------------------------------------------------------------------------------

    def _sample_metrics(self) -> None:
        if self.phase != "serving":
            return

        async def sample() -> dict[str, float]:
            return self._dist.coordinator.metrics() if self._dist is not None else {}

        self.bridge.call(sample(), "reading the metrics", timeout=10, on_result=self.metrics.emit,
                         on_error=lambda exc: log.debug("metrics: %s", exc))
