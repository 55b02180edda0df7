"""One ring of the fleet service: export (or reuse) the model with the ring's plan, distribute it
to the plan's agents, serve its coordinator under the service's router, re-run, stop.

:class:`ServiceRing` is the loop-side life of one :class:`~console.fleet.served_rings.ServedRing`.
The export job is polled by a task, the `Distributor` (and its failover) runs the ring, and once up its
coordinator joins the router under the ring's id, so adding or stopping a ring never touches the
others. Every change is published on the service's feed as a ``ring`` event (and export and
agent progress as ``export``/``progress``); the entry is written through to ``served-rings.json``
when its export exists, so a restart re-forms it with no export.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from console.fleet.distribution import DistributionTimeouts, Distributor
from console.fleet.errors import ExportNotFoundError
from console.fleet.export_job import ExportJob
from console.fleet.failover import FailoverSettings
from console.fleet.models import ModelLibrary
from console.fleet.ring_endpoints import free_port, ring_endpoints
from console.fleet.ring_layout import AgentEndpoint, RingLayout
from console.fleet.served_rings import ServedRing
from console.fleet_api.admin_shapes import plan_json, spec_json
from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import ExportEvent, ExportFailed, ExportFinished, ExportInfo, ExportProgress
from console.fleet_api.feed import EventKind
from console.fleet_api.fleet_settings import FleetSettings
from console.fleet_api.ring_status import AgentProgress, RingHealth, RingPhase
from engine.control.fleet_services import FleetHost
from engine.generation.ring_report import RingReport, RingStatus
from engine.generation.router import Router
from engine.generation.tokenizer import ChatTokenizer

log = logging.getLogger("deskfleet.fleet")

EXPORT_POLL_S = 0.1
EXPORT_TIMEOUT_S = 6 * 3600.0
REMOVE_DRAIN_S = 30.0  # a stopped ring's streams in flight get this long to finish

PHASES = ("pending", "exporting", "distributing", "serving", "failed", "stopping")


class RingStateError(FleetServiceError):
    """An action does not fit the ring's phase (re-run a ring that has not failed, …)."""


@dataclass
class RingContext:
    """What a ring needs from its service (all loop objects)."""

    host: FleetHost
    library: ModelLibrary
    settings: FleetSettings
    router: Router
    tokenizers: dict[str, ChatTokenizer]  # served model name -> tokenizer: the API reads it
    records: Callable[[], tuple[AgentRecord, ...]]
    publish: Callable[[EventKind, dict[str, Any]], None]
    persist: Callable[[ServedRing], object]  # its result is not used
    in_other_rings: Callable[[str], frozenset[str]]  # node ids the service's other rings use
    api_url: Callable[[], str]
    timeouts: DistributionTimeouts | None = None
    failover: FailoverSettings | None = None


class ServiceRing:
    """``async_run()`` brings the ring up (and resumes a failed one); ``async_stop()`` ends it."""

    def __init__(self, ctx: RingContext, served: ServedRing) -> None:
        self.ctx = ctx
        self.served = served
        self.phase = RingPhase.PENDING
        self.error: str | None = None
        self.export_state: dict[str, Any] | None = None
        self.health: RingHealth | None = None
        self.dist: Distributor | None = None
        self.job: ExportJob | None = None
        self.in_router = False
        self.down_since: float | None = None  # monotonic time the serving ring was first seen down
        self._lock = asyncio.Lock()  # one bring-up or stop at a time

    @property
    def ring_id(self) -> str:
        return self.served.ring

    # ---- what clients see ------------------------------------------------------------------------

    def report(self) -> RingReport:
        """The ring's RingReport: its coordinator's while it serves, else down with the phase."""
        if self.in_router:
            for report in self.ctx.router.ring_reports():
                if report.ring == self.ring_id:
                    return report
        detail = self.error if self.phase is RingPhase.FAILED and self.error else f"the ring is {self.phase}"
        return RingReport(self.ring_id, self.served.model, RingStatus.DOWN, detail)

    def to_json(self) -> dict[str, Any]:
        served = self.served
        dist = self.dist
        agents = [_progress_json(p) for p in dist.progress()] if dist is not None else []
        health = None if self.health is None else {"test_token": self.health.test_token,
                                                   "test_ms": self.health.test_ms, "error": self.health.error}
        return {"ring": served.ring, "model": served.model, "export_id": served.export_id, "phase": self.phase,
                "plan": plan_json(served.plan), "spec": spec_json(served.spec), "created": served.created,
                "standby": None if served.standby is None else list(served.standby),
                "export": self.export_state, "agents": agents, "health": health,
                "report": self.report().to_json() if self.phase is RingPhase.SERVING else None, "error": self.error}

    def _set_phase(self, phase: RingPhase, error: str | None = None) -> None:
        self.phase, self.error = phase, error
        self.ctx.publish(EventKind.RING, {"ring": self.to_json()})

    # ---- bring-up --------------------------------------------------------------------------------

    async def async_run(self) -> dict[str, Any]:
        """Export when the ring has none yet, distribute, serve; resumes after a failure. Raises
        what failed (the ring is then ``failed`` with that error)."""
        async with self._lock:
            if self.phase is RingPhase.SERVING:
                return self.to_json()
            try:
                export = await self._async_export()
                self._set_phase(RingPhase.DISTRIBUTING)
                await self._async_distribute(export)
            except asyncio.CancelledError:
                self._set_phase(RingPhase.FAILED, "the bring-up was cancelled")
                raise
            except Exception as exc:
                log.warning("ring %s: %s", self.ring_id, exc)
                self._set_phase(RingPhase.FAILED, str(exc) or type(exc).__name__)
                raise
            self.down_since = None
            self._set_phase(RingPhase.SERVING)
            return self.to_json()

    async def _async_export(self) -> ExportInfo:
        served = self.served
        if served.export_id is not None:
            with contextlib.suppress(ExportNotFoundError):
                return self.ctx.library.export(served.export_id)
            log.warning("ring %s: export %s is gone from the library; exporting again", served.ring, served.export_id)
        entry = next((m for m in self.ctx.library.models() if m.name == served.model), None)
        if entry is None:
            raise FleetServiceError(f"the model {served.model!r} is not in the service's library; add it (POST "
                               "/admin/v1/models) or create the ring from one of its exports")
        self._set_phase(RingPhase.EXPORTING)
        self.export_state = {"stage": None, "step": "starting", "fraction": 0.0}
        self.job = self.ctx.library.start_export(entry, plan=served.plan, spec=served.spec,
                                                 on_event=self._on_export_event)
        export = await async_finish_export(self.job)
        self.served = replace(served, export_id=export.export_id)
        self.ctx.persist(self.served)
        return export

    def _on_export_event(self, event: ExportEvent) -> None:
        data = export_event_json(event)
        if data["state"] == "progress":
            self.export_state = {k: data[k] for k in ("stage", "step", "fraction")}
        elif data["state"] == "finished":
            self.export_state = {"stage": None, "step": "finished", "fraction": 1.0}
        data = {"ring": self.ring_id, **data}
        self.ctx.publish(EventKind.EXPORT, data)

    async def _async_distribute(self, export: ExportInfo) -> None:
        ctx = self.ctx
        if self.dist is None or self.dist.export_id != export.export_id:
            if self.dist is not None:
                await self.dist.async_close()
            self.dist = self._distributor(export)
        await self._async_leave_router()
        self.health = await self.dist.async_run()
        if self.served.return_port != self.dist.return_port:  # fixed by the first listen: kept for a restart
            self.served = replace(self.served, return_port=self.dist.return_port)
            ctx.persist(self.served)
        tokenizer = await asyncio.to_thread(ChatTokenizer, self.dist.tokenizer_dir)
        ctx.tokenizers.setdefault(self.served.model, tokenizer)
        ctx.router.add_ring(self.ring_id, self.dist.coordinator, model_name=self.served.model)
        self.in_router = True

    def _distributor(self, export: ExportInfo) -> Distributor:
        ctx, settings = self.ctx, self.ctx.settings
        records = {r.node_id: r for r in ctx.records() if r.node_id}
        endpoints = ring_endpoints(self.served.plan, records, settings.data_port)
        layout = RingLayout.from_plan(self.served.plan, endpoints)
        standby = standby_endpoints(records.values(), endpoints, settings.data_port, self.served.standby,
                                    ctx.in_other_rings(self.ring_id))
        return Distributor(ctx.host, export.path, layout, export_id=export.export_id,
                           console_host=settings.interface, worker=settings.worker, api_url=ctx.api_url(),
                           on_progress=self._on_progress, timeouts=ctx.timeouts, standby=standby,
                           failover=ctx.failover, runtime=settings.runtime, return_port=self.served.return_port)

    def _on_progress(self, progress: AgentProgress) -> None:
        self.ctx.publish(EventKind.PROGRESS, {"ring": self.ring_id, **_progress_json(progress)})

    # ---- stop ------------------------------------------------------------------------------------

    def cancel_export(self) -> None:
        if self.job is not None and not self.job.done:
            self.job.cancel()

    async def async_leave(self) -> None:
        """Stop serving new requests here (streams in flight finish), keep the ring's workers."""
        await self._async_leave_router()

    async def _async_leave_router(self) -> None:
        if self.in_router:
            self.in_router = False
            with contextlib.suppress(FleetServiceError, Exception):
                await self.ctx.router.remove_ring(self.ring_id, timeout=REMOVE_DRAIN_S)

    async def async_stop(self, *, workers: bool = True) -> None:
        """Leave the router, then close the coordinator; ``workers`` False keeps the agents'
        workers running (the service is shutting down and will re-form the ring on its next start)."""
        self.phase = RingPhase.STOPPING
        self.ctx.publish(EventKind.RING, {"ring": self.to_json()})
        if self.job is not None and not self.job.done:
            await asyncio.to_thread(self.job.cancel)
        await self._async_leave_router()
        dist, self.dist = self.dist, None
        if dist is not None:
            await dist.async_close(stop_workers=workers)


def standby_endpoints(records: Collection[AgentRecord], ring: Mapping[str, AgentEndpoint], data_port: int,
                      chosen: tuple[str, ...] | None, busy: frozenset[str]) -> tuple[AgentEndpoint, ...]:
    """The agents that stand by for a ring: ``chosen`` (node ids), or every approved agent that is
    neither in this ring nor in another of the service's; data ports as ``ring_endpoints`` gives
    them (one more per agent sharing an address)."""
    per_address = collections.Counter(ep.control.rpartition(":")[0] for ep in ring.values())
    out = []
    for r in records:
        if not r.approved or not r.node_id or r.node_id in ring:
            continue
        if (chosen is not None and r.node_id not in chosen) or (chosen is None and r.node_id in busy):
            continue
        index, per_address[r.address] = per_address[r.address], per_address[r.address] + 1
        port = free_port(r.address) if data_port == 0 else data_port + index
        out.append(AgentEndpoint(r.control_address, port, r.name, r.node_id))
    return tuple(out)


def _progress_json(p: AgentProgress) -> dict[str, Any]:
    return {"agent": p.agent, "stage": p.stage, "phase": p.phase, "done_bytes": p.done_bytes,
            "total_bytes": p.total_bytes, "error": p.error}


def elapsed_down(ring: ServiceRing, now: float | None = None) -> float:
    """Seconds a serving ring has been reporting down (0 when it is not)."""
    now = time.monotonic() if now is None else now
    if ring.phase is not RingPhase.SERVING or ring.report().status is not RingStatus.DOWN:
        ring.down_since = None
        return 0.0
    if ring.down_since is None:
        ring.down_since = now
    return now - ring.down_since


def export_event_json(event: ExportEvent) -> dict[str, Any]:
    """An export job's event as the feed's ``export`` data (without whose export it is: the
    caller adds its ring or job)."""
    if isinstance(event, ExportProgress):
        return {"state": "progress", "stage": event.stage, "step": event.step, "fraction": event.fraction}
    if isinstance(event, ExportFinished):
        return {"state": "finished", "export_id": event.export.export_id, "reused": event.reused, "fraction": 1.0}
    if isinstance(event, ExportFailed):
        return {"state": "failed", "message": event.message}
    return {"state": "cancelled"}


async def async_finish_export(job: ExportJob) -> ExportInfo:
    """Wait for ``job``'s export; a cancelled wait stops the export process (nothing left behind)."""
    try:
        return await job.async_wait(EXPORT_TIMEOUT_S, EXPORT_POLL_S)
    except asyncio.CancelledError:
        await asyncio.to_thread(job.cancel)
        raise
