"""The Distribution, Chat and Metrics pages' controller: ``distribute``, ``rerun``, ``stop``,
``cancel_export`` and the signals the pages follow. The export, the distribution, the
coordinator and the API all run in the fleet service, as one of its rings; this object follows
that ring through the service's event feed, and closing the console leaves it serving.

A console that attaches shows the ring the service already serves (several consoles see the
same one); distributing a new plan replaces the ring this page shows, as the console always did
(the service itself serves as many rings as it is given: other consoles' or the API's own).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from console.fleet_api.admin_shapes import plan_from_json
from console.fleet_api.exports import ExportFailed, ExportFinished, ExportInfo, ExportKey, ExportProgress
from console.fleet_api.feed import Event, EventKind
from console.fleet_api.ring_status import AgentPhase, AgentProgress, RingHealth, RingPhase
from console.qt.service_bridge import ServiceBridge
from console.qt.session import Serving
from engine.placement.types import Plan

log = logging.getLogger("deskfleet.console")

RING_TIMEOUT_S = 60.0


class ServingPhase(StrEnum):
    """Where the ring this console shows is: IDLE (none), else its ring's phase in the service as
    the console follows it (a pending ring shows as distributing)."""

    IDLE = "idle"
    EXPORTING = RingPhase.EXPORTING.value
    DISTRIBUTING = RingPhase.DISTRIBUTING.value
    SERVING = RingPhase.SERVING.value
    STOPPING = RingPhase.STOPPING.value
    FAILED = RingPhase.FAILED.value


def serving_phase(ring_phase: object) -> ServingPhase:
    """The console's phase for a ring's ``phase`` in the admin API (an unknown one: distributing)."""
    try:
        return ServingPhase(str(ring_phase))
    except ValueError:
        return ServingPhase.DISTRIBUTING


def agent_phase(value: object) -> AgentPhase:
    """An agent's bring-up phase from the admin API (one this console does not know: failed)."""
    try:
        return AgentPhase(str(value))
    except ValueError:
        log.warning("the service reports an agent phase this console does not know: %r", value)
        return AgentPhase.FAILED


class ServiceServing(QObject):
    """The ring this console shows: ``ring`` is its id in the service (None: none yet)."""

    export_event = Signal(object)
    progress = Signal(object)
    health = Signal(object)
    failed = Signal(str)
    phase_changed = Signal(str)
    api_ready = Signal(str)
    metrics = Signal(object)
    api_key_known = Signal()  # the console's own API key was read (``api_key``)

    def __init__(self, bridge: ServiceBridge, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.phase = ServingPhase.IDLE
        self.ring: str | None = None
        self.api_url: str | None = None
        self.api_key: str | None = None
        self._plan: Plan | None = None
        self._error: str | None = None
        self._sampling = False  # a metrics read is on its way
        self._last_sample = -1e9  # monotonic time of the last metrics sample shown
        self._sampler = QTimer(self)  # the console's own cadence (the feed's is the service's, >= 2 s)
        self._sampler.setInterval(max(50, int(bridge.settings.metrics_s * 1000)))
        self._sampler.timeout.connect(self._sample)
        bridge.started.connect(self._attached)
        bridge.service_event.connect(self._on_event)

    @property
    def ca_pem(self) -> bytes | None:
        """The fleet CA (from the admin client): what the Chat page trusts an https API by."""
        return self.bridge.ca_pem

    @property
    def can_rerun(self) -> bool:
        return self.phase is ServingPhase.FAILED and self.ring is not None

    def _set_phase(self, phase: ServingPhase) -> None:
        if phase != self.phase:
            self.phase = phase
            self.phase_changed.emit(phase)
        if phase is ServingPhase.SERVING:
            self._sampler.start()
        else:
            self._sampler.stop()

    def _sample(self) -> None:
        """Read the ring's metrics every ``settings.metrics_s`` (the Metrics page's samples)."""
        if self._sampling or self.ring is None or not self.bridge.running:
            return
        self._sampling, ring = True, self.ring

        def took(rings: Mapping[str, Any]) -> None:
            self._sampling = False
            sample = rings.get(ring)
            if sample is not None and ring == self.ring and self.phase is ServingPhase.SERVING:
                self._emit_metrics(sample)

        def missed(exc: BaseException) -> None:
            self._sampling = False
            log.debug("reading the ring's metrics: %s", exc)

        self.bridge.call(self.bridge.client.async_metrics(), "reading the ring's metrics", on_result=took,
                         on_error=missed)

    def _emit_metrics(self, sample: Mapping[str, Any]) -> None:
        """One sample per ``metrics_s`` at most, whether read or from the feed (the service's own
        cadence, for every client)."""
        now = time.monotonic()
        if now - self._last_sample >= 0.5 * self._sampler.interval() / 1000:
            self._last_sample = now
            self.metrics.emit(dict(sample))

    # ---- attaching -------------------------------------------------------------------------------

    def _attached(self) -> None:
        client = self.bridge.client

        async def read() -> tuple[list[dict[str, Any]], str | None]:
            rings = await client.async_rings()
            try:
                secret = await client.async_console_secret()
            except Exception as exc:  # a service without keys, or an older one: the chat says so itself
                log.info("no console key from the service: %s", exc)
                secret = None
            return rings, secret

        self.bridge.call(read(), "reading the service's rings", on_result=self._take_rings)

    def _take_rings(self, result: tuple[list[dict[str, Any]], str | None]) -> None:
        rings, self.api_key = result
        self.api_key_known.emit()
        if self.ring is None and rings:
            shown = next((r for r in rings if r.get("phase") == RingPhase.SERVING), rings[0])
            self.ring = str(shown["ring"])
            self._apply_ring(shown)

    # ---- actions ---------------------------------------------------------------------------------

    def distribute(self, plan: Plan) -> None:
        """Have the service export (or reuse) the session's model with ``plan``'s split and bring it
        up as a ring; the ring this page showed before is stopped first."""
        session = self.bridge.session
        if session.model is None:
            self._fail("choose a model on the Models page first")
            return
        if self.phase in (ServingPhase.EXPORTING, ServingPhase.DISTRIBUTING, ServingPhase.STOPPING):
            return
        self._plan, old = plan, self.ring
        client, model, spec = self.bridge.client, session.model.name, session.spec
        self._set_phase(ServingPhase.EXPORTING)

        async def create() -> dict[str, Any]:
            if old is not None:
                await client.async_stop_ring(old)
            return (await client.async_create_ring(model, plan, spec=spec))["ring"]

        def created(ring: dict[str, Any]) -> None:
            self.ring = str(ring["ring"])
            self._apply_ring(ring)

        self.bridge.call(create(), "creating the ring", timeout=RING_TIMEOUT_S * 3, on_result=created,
                         on_error=lambda exc: self._fail(str(exc)))

    def cancel_export(self) -> None:
        if self.ring is not None and self.phase is ServingPhase.EXPORTING and self.bridge.running:
            self.bridge.call(self.bridge.client.async_cancel(self.ring), "cancelling the export")

    def rerun(self) -> None:
        ring = self.ring
        if not self.can_rerun or ring is None:
            return
        self._set_phase(ServingPhase.DISTRIBUTING)
        self.bridge.call(self.bridge.client.async_rerun(ring), "re-running the ring",
                         on_result=lambda answer: self._apply_ring(answer["ring"]),
                         on_error=lambda exc: self._fail(str(exc)))

    def stop(self) -> None:
        """Stop the ring this page shows, in the service (its workers stop; other rings go on)."""
        if self.ring is None:
            self._stopped()
            return
        self._set_phase(ServingPhase.STOPPING)
        self.bridge.call(self.bridge.client.async_stop_ring(self.ring), "stopping the ring", timeout=RING_TIMEOUT_S * 2,
                         on_result=lambda _: self._stopped(), on_error=lambda exc: self._stopped())

    def _stopped(self) -> None:
        self.ring = self.api_url = None
        self.bridge.session.set_serving(None)
        self._set_phase(ServingPhase.IDLE)

    # ---- news from the service -------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        data = event.data
        if event.kind is EventKind.RING and self._mine(data.get("ring", {}).get("ring")):
            self._apply_ring(data["ring"])
        elif event.kind is EventKind.RING_REMOVED and self._mine(data.get("ring")):
            self._stopped()
        elif event.kind is EventKind.EXPORT and self._mine(data.get("ring")):
            self._on_export(data)
        elif event.kind is EventKind.PROGRESS and self._mine(data.get("ring")):
            self.progress.emit(_progress(data))
        elif event.kind is EventKind.METRICS and self.ring is not None and self.phase is ServingPhase.SERVING:
            sample = data.get("rings", {}).get(self.ring)
            if sample is not None:
                self._emit_metrics(sample)

    def _mine(self, ring: object) -> bool:
        return ring is not None and ring == self.ring

    def _on_export(self, data: Mapping[str, Any]) -> None:
        state = data.get("state")
        if state == "progress":
            self.export_event.emit(ExportProgress(data.get("stage"), str(data.get("step", "")),
                                                  float(data.get("fraction", 0.0))))
        elif state == "finished":
            self.export_event.emit(ExportFinished(self._export_info(str(data.get("export_id", ""))),
                                                  bool(data.get("reused", False)), float(data.get("seconds", 0.0))))
        elif state in ("failed", "cancelled"):
            self.export_event.emit(ExportFailed(str(state), str(data.get("message", state))))

    def _export_info(self, export_id: str) -> ExportInfo:
        """What the page shows of an export made in the service (its files live there)."""
        from pathlib import Path

        plan = self._plan
        layers = tuple((s.first_layer, s.last_layer) for s in plan.stages) if plan is not None else ()
        model = self.bridge.session.model.name if self.bridge.session.model is not None else ""
        return ExportInfo(export_id=export_id, path=Path(export_id), name=model, fingerprint="",
                          weights=self.bridge.session.spec.weights, stages=len(layers), layers=layers, size_bytes=0,
                          created="", key=ExportKey("", self.bridge.session.spec.weights,
                                                    tuple(a for a, _ in layers[1:]), ""))

    def _apply_ring(self, ring: Mapping[str, Any]) -> None:
        phase = serving_phase(ring.get("phase", ServingPhase.IDLE))
        if ring.get("plan"):
            try:
                self._plan = plan_from_json(ring["plan"])
            except Exception as exc:
                log.warning("the service's plan for ring %s does not read: %s", ring.get("ring"), exc)
        for agent in ring.get("agents") or ():
            self.progress.emit(_progress(agent))
        if phase is ServingPhase.SERVING and self.phase is not ServingPhase.SERVING:
            self._served(ring)
        elif phase is ServingPhase.FAILED and (self.phase is not ServingPhase.FAILED
                                               or ring.get("error") != self._error):
            self._error = ring.get("error")
            self._fail(str(ring.get("error") or "the ring failed"))
            return
        self._set_phase(phase)

    def _served(self, ring: Mapping[str, Any]) -> None:
        url = str(self.bridge.service.get("api_url") or "")
        self.api_url = url or None
        check = ring.get("health") or {}
        agents = tuple(_progress(a) for a in ring.get("agents") or ())
        self.health.emit(RingHealth(agents, False, check.get("test_token"), float(check.get("test_ms") or 0.0),
                                    check.get("error")))
        if self._plan is not None:
            self.bridge.session.set_serving(Serving(self._plan, str(ring.get("export_id") or ""), False, self.api_url))
        self._set_phase(ServingPhase.SERVING)
        if self.api_url:
            self.api_ready.emit(self.api_url)

    def _fail(self, message: str) -> None:
        log.warning("ring: %s", message)
        self._set_phase(ServingPhase.FAILED)
        self.failed.emit(message)


def _progress(data: Mapping[str, Any]) -> AgentProgress:
    return AgentProgress(str(data.get("agent", "")), int(data.get("stage", 0)), agent_phase(data.get("phase")),
                         int(data.get("done_bytes", 0)), int(data.get("total_bytes", 0)), data.get("error"))
