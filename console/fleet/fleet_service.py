"""``deskfleet fleet``: the headless fleet service. It owns what the console's loop thread owned —
the fleet CA, join tokens, enrolment, the hub, the mDNS browser, agent records and approvals,
the model library and exports, placements, one `Distributor` per ring with its failover, a
:class:`~engine.generation.router.Router` over the rings' coordinators and the OpenAI API on it —
and serves whether or not a console is open. Consoles attach through the admin API
(:mod:`console.fleet.admin_api`, docs/ADMIN_API.md); any number at once, all seeing the same
state through the event feed.

Everything lives on one asyncio loop (the process's). What it serves is persisted
(:mod:`console.fleet.served_rings`); at start it re-forms every ring there with no admin action
(agents keep verified shards; the same return port and API address give each agent the
assignment it already holds, so a worker that kept running keeps running), retrying with a
back-off while agents are not back yet. A serving ring that reports down for ``down_grace_s`` (its
failover gave up) is rebuilt the same way. Placements persist too
(:mod:`console.fleet.placement_store`): a placement id answers after a restart.

The CA key: its file is encrypted under a wrapping key kept by :class:`engine.trust.keystore.ConsoleSecrets`
— the OS keyring of the user the service runs as, or, where that user has none (a system service),
the 0600 file keyring in the state dir (``keyring.json``; ``$DESKFLEET_KEYRING_DIR`` moves it elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Collection, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from console.fleet.admin_api import ADMIN_SOCKET, async_run_admin
from console.fleet.distribution import DistributionTimeouts
from console.fleet.failover import FailoverSettings
from console.fleet.failover_tally import FailoverTally
from console.fleet.fleet import FleetModel
from console.fleet.fleet_prometheus import FleetFigures, serving_figures
from console.fleet.join_tokens import TokenDesk
from console.fleet.links import async_measure_links
from console.fleet.models import ModelLibrary
from console.fleet.placement_store import (
    Placement,
    PlacementNotFoundError,  # noqa: F401 (named here before)
    PlacementStore,
)
from console.fleet.placing import async_new_placement, async_solve_again, checked_tags, ring_pcs
from console.fleet.records_feed import RecordsPublisher
from console.fleet.served_rings import ServedRing, ServedRings, check_ring_id, next_ring_id
from console.fleet.service_endpoints import (
    async_advertise_api,
    async_run_service_api,
    remove_service_file,
    write_service_file,
)
from console.fleet.service_events import EventFeed, Jobs
from console.fleet.service_ring import (
    RingContext,
    RingStateError,
    ServiceRing,
    async_finish_export,
    elapsed_down,
    export_event_json,
)
from console.fleet_api.admin_shapes import agent_json, export_json, model_json, plan_json
from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import ExportEvent, ExportSpec
from console.fleet_api.feed import EventKind
from console.fleet_api.fleet_settings import FleetSettings
from console.fleet_api.model_entry import ModelEntry
from console.fleet_api.ring_status import RingPhase
from engine.api.server import RunningApi
from engine.control.fleet_services import FleetHost, fleet_host
from engine.control.hub import AgentEvent
from engine.control.hub_events import public_body
from engine.discovery.mdns import Browser
from engine.generation.ring_report import overall_status
from engine.generation.router import Router
from engine.generation.tokenizer import ChatTokenizer
from engine.placement.types import PlacementRequest, Plan
from engine.suppress import logged_suppress
from engine.tasks import start_task

log = logging.getLogger("deskfleet.fleet")

PLACE_TIMEOUT_S = 1800.0
DEFAULT_SPEC = ExportSpec()
RETRY_S = (2.0, 5.0, 10.0, 30.0)  # re-forming a ring after a restart or a failover that gave up


@dataclass(frozen=True)
class FleetServiceSettings:
    """``admin_port`` None: the admin API on the local socket only. ``browse`` False: no mDNS
    browser (agents are then found through the hub and by address only); ``advertise_api``
    False: the OpenAI API is not advertised over mDNS (``_deskfleet-api._tcp``); ``advertise``
    False: nor is the enrolment port (PCs then join with the fleet service's address given)."""

    fleet: FleetSettings
    admin_host: str = "127.0.0.1"
    admin_port: int | None = 7222
    down_grace_s: float = 15.0
    watch_s: float = 1.0
    retry_s: tuple[float, ...] = RETRY_S
    browse: bool = True
    advertise_api: bool = True
    advertise: bool = True
    timeouts: DistributionTimeouts | None = None
    failover: FailoverSettings | None = None

    @property
    def state_dir(self) -> Path:
        return self.fleet.state_dir


class RingNotFoundError(FleetServiceError):
    """A ring id names no ring the service serves."""


class ModelNotFoundError(FleetServiceError):
    """A model name is not in the service's library."""


class FleetService:
    """Opened by :meth:`async_open` (every part built before the object exists), served, then
    ``await async_close()``. Every method runs on the loop."""

    def __init__(self, settings: FleetServiceSettings, stack: contextlib.AsyncExitStack, *, host: FleetHost,
                 fleet: FleetModel, served: ServedRings, placements: PlacementStore, router: Router,
                 tokenizers: dict[str, ChatTokenizer], api: RunningApi) -> None:
        """The parts :meth:`async_open` built; ``stack`` closes them (and what the service adds) at
        :meth:`async_close`."""
        self.settings = settings
        self.host = host
        self.fleet = fleet
        self.served = served
        self.placements = placements
        self.router = router
        self.tokenizers = tokenizers
        self.api = api
        self.library = ModelLibrary(settings.state_dir)
        self.feed = EventFeed(self._snapshot, latest_only=(EventKind.RECORDS,))
        self.records_feed = RecordsPublisher(fleet.records, self._publish_records)
        self.jobs = Jobs(self.feed)
        self.token_desk = TokenDesk(host.tokens, host.audit, self._publish)
        self.token = host.token()
        self.rings: dict[str, ServiceRing] = {}
        self.admin_url: str | None = None  # the admin API over HTTPS, when settings.admin_port asks for one
        self.started_at = time.time()
        self.failovers = FailoverTally(settings.state_dir)  # the Dashboard's "failovers today"
        # /metrics (in the API's registry: every ring labelled, every agent) and GET /admin/v1/metrics
        self.figures = FleetFigures(lambda: serving_figures(self.rings), fleet.records,
                                    lambda: [r.phase for r in self.rings.values()])
        api.metrics.use_generator(self.figures)
        self._stack = stack
        self._tasks: set[asyncio.Task[Any]] = set()  # held by start_task; cancelled at the close
        self._auto: dict[str, tuple[int, float]] = {}  # ring -> (attempts, next monotonic time) to re-form it
        self._last_health: Any = None
        self._closed = False

    @classmethod
    async def async_open(cls, settings: FleetServiceSettings) -> FleetService:
        """Build the service's parts (state files, fleet host, fleet model, OpenAI API), then serve:
        the admin API, the mDNS browser, the rings served before re-formed. A part that fails
        closes what was built and raises."""
        s = settings.fleet
        s.state_dir.mkdir(parents=True, exist_ok=True)
        stack = contextlib.AsyncExitStack()
        try:
            served = ServedRings(s.state_dir)
            placements = PlacementStore(s.state_dir)  # a damaged file stops the start, named
            host = await stack.enter_async_context(
                fleet_host(s.state_dir, host=s.interface, enrollment_port=s.enrollment_port, hub_port=s.hub_port,
                           advertise_on=s.interface if settings.advertise else None, name="Deskfleet fleet"))
            fleet = FleetModel(s.state_dir, host.credentials)
            router, tokenizers = Router(), dict[str, ChatTokenizer]()
            api = await async_run_service_api(s, host, served, router, tokenizers)
            stack.push_async_callback(api.async_stop)
            service = cls(settings, stack, host=host, fleet=fleet, served=served, placements=placements,
                          router=router, tokenizers=tokenizers, api=api)
        except BaseException:
            await stack.aclose()
            raise
        try:
            await service._async_serve()
        except BaseException:
            await service.async_close()
            raise
        log.info("fleet %s: PCs join at %s; OpenAI API at %s; admin API on %s%s", fleet.fleet_id, host.enrollment,
                 service.api_url, s.state_dir / ADMIN_SOCKET, f" and {service.admin_url}" if service.admin_url else "")
        return service

    def _publish(self, kind: EventKind, data: dict[str, Any]) -> None:
        self.feed.publish(kind, data)

    def _publish_records(self, agents: list[dict[str, Any]]) -> None:
        self.feed.publish(EventKind.RECORDS, {"agents": agents})

    # ---- lifecycle -------------------------------------------------------------------------------

    async def _async_serve(self) -> None:
        fleet, host, desk, stack = self.fleet, self.host, self.token_desk, self._stack
        stack.callback(fleet.subscribe(self._on_records))
        stack.callback(fleet.subscribe(desk.on_records))  # before the hub's news
        stack.callback(host.subscribe_joins(desk.on_join))
        stack.callback(fleet.attach_hub(host.hub))
        stack.callback(fleet.attach_api_key(host.rotate_api_key, host.member_key))
        stack.callback(host.hub.subscribe(self._on_hub_event))
        stack.callback(host.hub.subscribe(self.figures.pauses.on_event))
        stack.callback(host.subscribe_api_key(self.api.set_api_key))
        desk.attach(fleet.approve, fleet.records())
        interface = self.settings.fleet.interface
        if self.settings.browse:
            browser = Browser(interface, fleet.update_peers)
            await browser.async_start()
            stack.push_async_callback(browser.async_close)
        if self.settings.advertise_api:  # mDNS probing takes ~1.6 s: serve meanwhile
            self._start(async_advertise_api(fleet.fleet_id, self.api, interface, stack), "api-advert")
        self.admin_url = await async_run_admin(self, stack)
        write_service_file(self.settings.state_dir, {
            "admin_socket": str(self.settings.state_dir / ADMIN_SOCKET), "admin_url": self.admin_url,
            "api_url": self.api_url, "enrollment": host.enrollment, "fleet_id": fleet.fleet_id,
            "started_at": self.started_at})
        for served in self.served.state.rings:  # re-form what was served before
            self._add_ring(served, auto=True)
        self._start(self._async_watch(), "fleet-watch")
        self._start(self._async_refresh_loop(), "fleet-refresh")

    def _start(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        start_task(coro, name=f"deskfleet-{what}", logger=log, keep=self._tasks)

    async def async_close(self, *, stop_workers: bool = False) -> None:
        """Stop serving here. ``stop_workers`` False (a restart, SIGTERM) leaves the agents' workers
        running and the rings listed, so the next start re-forms them at once. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a failure was logged by start_task
        self.records_feed.cancel()
        await self.jobs.async_close()
        for ring in list(self.rings.values()):
            with logged_suppress(log, f"stopping ring {ring.ring_id}", level=logging.WARNING):
                await ring.async_stop(workers=stop_workers)
        await self._stack.aclose()
        remove_service_file(self.settings.state_dir)

    @property
    def api_url(self) -> str:
        return self.api.url

    # ---- news ------------------------------------------------------------------------------------

    def _on_records(self, records: tuple[AgentRecord, ...]) -> None:
        self.records_feed.on_records(records)  # throttled: console.fleet.records_feed

    def _on_hub_event(self, event: AgentEvent) -> None:
        self.feed.publish(EventKind.HUB, {"node_id": event.node_id, "event": event.event, "body": public_body(event)})

    def health_json(self) -> dict[str, Any]:
        reports = tuple(r.report() for r in self.rings.values())
        return {"status": overall_status(reports).value, "rings": [r.to_json() for r in reports]}

    def metrics_json(self) -> dict[str, Any]:
        out = {r.ring: dict(r.metrics) for r in self.figures.rings()}  # what /metrics renders, unlabelled
        return {"rings": out, "failovers_today": self.failovers.observe(out)}

    def _snapshot(self) -> list[tuple[EventKind, dict[str, Any]]]:
        out: list[tuple[EventKind, dict[str, Any]]] = [
            (EventKind.RECORDS, {"agents": self.records_feed.cache.dump(self.fleet.records())})]
        out.append((EventKind.TOKEN, {"token": self.token}))
        out += [(EventKind.RING, {"ring": r.to_json()}) for r in self.rings.values()]
        out.append((EventKind.HEALTH, self.health_json()))
        return out

    async def _async_watch(self) -> None:
        """Health changes to the feed; metrics while serving; rings to re-form, when due. One
        failed round is logged and the next goes on: the watch must outlive any one ring's fault."""
        last_metrics = 0.0
        while True:
            await asyncio.sleep(self.settings.watch_s)
            try:
                last_metrics = self._watch_once(time.monotonic(), last_metrics)
            except Exception:
                log.exception("a round of the fleet watch failed")

    def _watch_once(self, now: float, last_metrics: float) -> float:
        health = self.health_json()
        if health != self._last_health:
            self._last_health = health
            self.feed.publish(EventKind.HEALTH, health)
        if now - last_metrics >= max(self.settings.fleet.metrics_s, 2.0) and any(
                r.in_router for r in self.rings.values()):
            last_metrics = now
            self.feed.publish(EventKind.METRICS, self.metrics_json())
        for ring_id, ring in list(self.rings.items()):
            if elapsed_down(ring, now) > self.settings.down_grace_s:
                log.warning("ring %s has been down %.0f s (%s); rebuilding it", ring_id,
                            self.settings.down_grace_s, ring.report().detail)
                ring.phase = RingPhase.FAILED
                self._auto.setdefault(ring_id, (0, now))
            due = self._auto.get(ring_id)
            if due is not None and ring.phase is RingPhase.FAILED and now >= due[1]:
                self._rerun(ring, auto=True)
        return last_metrics

    async def _async_refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.fleet.refresh_s)
            with logged_suppress(log, "refreshing the agents' records"):
                await self.fleet.async_refresh()

    # ---- tokens and agents -----------------------------------------------------------------------

    def new_token(self, ttl_s: float | None = 24 * 3600, **options: Any) -> dict[str, Any]:
        """A new join token (``options``: uses, auto_approve, label; see TokenDesk), the fleet service's current one."""
        data = self.token_desk.issue({"ttl_s": ttl_s, **options})
        self.token = data["token"]
        self.feed.publish(EventKind.TOKEN, {"token": self.token, "expires_at": data["expires_at"]})
        return data

    def agents(self) -> list[dict[str, Any]]:
        return self.records_feed.cache.dump(self.fleet.records())

    def approve(self, key: str) -> dict[str, Any]:
        record = self.fleet.approve(key)
        self.token_desk.note_approved(record)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a caller off the loop: the PC learns the address with its first assignment
            log.debug("approved %s off the loop: its chat address comes with its assignment", record.name)
        else:
            self._start(self._async_tell_fleet_api(record.key, record.name), "tell-fleet-api")
        return agent_json(record)

    async def _async_tell_fleet_api(self, key: str, name: str) -> None:
        """Give a PC just approved the fleet's OpenAI API address: its tray's chat opens now, not
        once it is given a part of a model (its key came with its join). A PC not told learns the
        address with its first assignment."""
        try:
            await self.fleet.client(key).async_set_fleet_api(self.api_url)
        except Exception as exc:  # an older agent (404), or it went away: the assignment carries it later
            log.info("could not give %s the fleet's chat address: %s", name, exc)

    def remove(self, key: str) -> None:
        """Revoke the agent (deny list, pushed to every member; the `console` key rotated) and every
        API key issued to it (its tray's): the running API refuses them from the next request."""
        record = self.fleet.get(key)
        node_id = record.node_id
        self.fleet.remove(key)
        self.token_desk.note_removed(record.key, record.name)
        if node_id and (revoked := self.host.revoke_member_keys(node_id)):
            log.warning("removed agent %s: its API keys %s are revoked", node_id[:16], ", ".join(revoked))
            book = self.host.keys
            live = [k.to_json() for k in book.keys() if k.live] if book is not None else []
            self.feed.publish(EventKind.KEYS, {"keys": live})

    async def async_pause(self, key: str) -> dict[str, Any]:
        return agent_json(await self.fleet.async_pause(key))

    async def async_resume(self, key: str) -> dict[str, Any]:
        return agent_json(await self.fleet.async_resume(key))

    async def async_add_address(self, host: str, port: int) -> dict[str, Any]:
        return agent_json(await self.fleet.async_add_address(host, port))

    async def async_refresh(self) -> list[dict[str, Any]]:
        return [agent_json(r) for r in await self.fleet.async_refresh()]

    def measure_links(self, node_ids: Collection[str]):
        from console.fleet_api.admin_shapes import links_json

        return self.jobs.start("links", async_measure_links(self.fleet, list(node_ids)), to_json=links_json)

    # ---- models and placement --------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        return [model_json(m) for m in self.library.models()]

    def add_model(self, path: str) -> dict[str, Any]:
        return model_json(self.library.add_model(path))

    def exports(self) -> list[dict[str, Any]]:
        return [export_json(e) for e in self.library.exports()]

    def model_entry(self, name: str) -> ModelEntry:
        entry = next((m for m in self.library.models() if m.name == name), None)
        if entry is None:
            names = ", ".join(m.name for m in self.library.models())
            raise ModelNotFoundError(f"there is no model {name!r} in the service's library (models: {names})")
        return entry

    def place(self, model: str, request: PlacementRequest, *, context: int | None = None,
              spec: ExportSpec = DEFAULT_SPEC, leave_out: Collection[str] = (), include_tags: Collection[str] = (),
              exclude_tags: Collection[str] = ()):
        """Measure, calibrate (cached) and solve for ``model``, as a job; its result is the
        placement (console.fleet.placing: ``context`` None is the model's maximum capped by
        memory; tags keep to / avoid agents; TagError at once for a bad tag)."""
        include, exclude = checked_tags(include_tags, exclude_tags)
        entry = self.model_entry(model)

        async def place() -> Placement:
            checkpoint = await asyncio.to_thread(_checkpoint_of, entry)
            return self.placements.put(await async_new_placement(
                self.fleet, self.host.hub, checkpoint, placement_id=self.placements.new_id(), model=model, spec=spec,
                request=request, context=context, leave_out=leave_out, include=include, exclude=exclude,
                steps=self.settings.fleet.calibration_steps, threads=self.settings.fleet.worker.threads))

        return self.jobs.start("place", asyncio.wait_for(place(), PLACE_TIMEOUT_S),
                               to_json=lambda p: {"placement": p.to_json()})

    def placement(self, placement_id: str) -> Placement:
        return self.placements.get(placement_id)

    async def async_solve(self, placement_id: str, request: PlacementRequest, leave_out: Collection[str], *,
                          include_tags: Collection[str] | None = None,
                          exclude_tags: Collection[str] | None = None) -> Plan:
        """Solve the placement again (tags None: the placement's own; the agents' tags as now)."""
        placement = self.placement(placement_id)
        plan = await async_solve_again(self.fleet, placement, request, leave_out, include_tags, exclude_tags)
        self.placements.put(placement)
        return plan

    def set_tags(self, key: str, tags: Collection[str] | None) -> dict[str, Any]:
        """The admin's tags for agent ``key`` (None: its own count again); its AGENT object."""
        return agent_json(self.fleet.set_tags(key, None if tags is None else tuple(tags)))

    async def async_propose_rings(self, placement_id: str, request: PlacementRequest, *, standbys: int = 1,
                                  rings: int | None = None, leave_out: Collection[str] = (),
                                  include_tags: Collection[str] | None = None,
                                  exclude_tags: Collection[str] | None = None) -> dict[str, Any]:
        """How many rings of the placement's model the agents allow, with ``standbys`` kept aside;
        the rings already served stay as they are (a new ring never moves one). Tags None: the
        placement's own."""
        from engine.placement.rings import plan_rings
        from engine.placement.types import RingsRequest

        placement = self.placement(placement_id)
        inputs = placement.inputs
        pcs, reasons = ring_pcs(placement, self.fleet.records(), leave_out, include_tags, exclude_tags)
        known = {pc.pc_id for pc in pcs}
        existing = tuple(r.served.plan for r in self.rings.values()
                         if all(st.pc_id in known for st in r.served.plan.stages))
        ask = RingsRequest(rings=rings, standbys=standbys, placement=request, existing=existing)
        proposal = await asyncio.wait_for(asyncio.to_thread(
            plan_rings, ask, model=inputs.model, pcs=pcs, devices=inputs.devices, links=inputs.links.links),
            request.time_limit_s * (rings or 8) + 30)
        return {"rings": [plan_json(p) for p in proposal.rings], "standby": list(proposal.standbys),
                "unused": list(proposal.unused), "limit": proposal.limit, "standby_gaps": list(proposal.standby_gaps),
                "excluded": [{"pc_id": e.pc_id, "reason": reasons.get(e.pc_id, e.reason)} for e in proposal.excluded],
                "aggregate_tok_s": proposal.aggregate_tok_s}

    def start_export(self, model: str, plan: Plan, *, spec: ExportSpec = DEFAULT_SPEC):
        """Export ``model`` with ``plan``'s split (an identical export is reused), as a job: its
        progress goes on the feed as ``export`` events carrying the job's id, its result is the
        export; cancelling the job stops the export process and leaves nothing behind."""
        entry = self.model_entry(model)
        job_id: list[str] = []

        def on_event(event: ExportEvent) -> None:
            self.feed.publish(EventKind.EXPORT, {"job": job_id[0] if job_id else None, **export_event_json(event)})

        async def run() -> dict[str, Any]:
            export_job = self.library.start_export(entry, plan=plan, spec=spec, on_event=on_event)
            info = await async_finish_export(export_job)
            return {"export": export_json(info), "reused": export_job.reused}

        job = self.jobs.start("export", run())
        job_id.append(job.id)
        return job

    # ---- rings -----------------------------------------------------------------------------------

    def _context(self) -> RingContext:
        return RingContext(self.host, self.library, self.settings.fleet, self.router, self.tokenizers,
                           self.fleet.records, self._publish, self.served.put, self._in_other_rings,
                           lambda: self.api_url, self.settings.timeouts, self.settings.failover)

    def _in_other_rings(self, ring_id: str) -> frozenset[str]:
        return frozenset(n for r in self.rings.values() if r.ring_id != ring_id for n in r.served.node_ids)

    def ring(self, ring_id: str) -> ServiceRing:
        ring = self.rings.get(ring_id)
        if ring is None:
            raise RingNotFoundError(f"there is no ring {ring_id!r} (rings: {', '.join(self.rings) or 'none'})")
        return ring

    def _add_ring(self, served: ServedRing, *, auto: bool):
        ring = self.rings[served.ring] = ServiceRing(self._context(), served)
        if auto:
            self._auto[served.ring] = (0, time.monotonic())
        return self._start_run(ring, "restore" if auto else "ring")

    def _start_run(self, ring: ServiceRing, kind: str):
        async def run() -> dict[str, Any]:
            try:
                result = await ring.async_run()
            except Exception:
                if ring.ring_id in self._auto:
                    attempts, _ = self._auto[ring.ring_id]
                    delay = self.settings.retry_s[min(attempts, len(self.settings.retry_s) - 1)]
                    self._auto[ring.ring_id] = (attempts + 1, time.monotonic() + delay)
                raise
            self._auto.pop(ring.ring_id, None)
            return {"ring": result}

        ring.phase = RingPhase.PENDING
        return self.jobs.start(kind, run(), ring=ring.ring_id)

    def create_ring(self, plan: Plan, *, model: str | None = None, export_id: str | None = None,
                    spec: ExportSpec = DEFAULT_SPEC, ring_id: str | None = None,
                    standby: tuple[str, ...] | None = None):
        """A new ring from a plan: of ``model`` (exported with the plan's split, an identical export
        reused) or of the library's export ``export_id``. Returns (ring, job)."""
        if ring_id is None:
            ring_id = next_ring_id(self.rings)
        check_ring_id(ring_id)
        if ring_id in self.rings:
            raise RingStateError(f"ring {ring_id!r} exists; stop it first or pick another id")
        if export_id is not None:
            info = self.library.export(export_id)
            if info.stages != len(plan.stages):
                raise RingStateError(f"export {export_id} has {info.stages} stages and the plan {len(plan.stages)}; "
                                     "place it again with that many stages")
            model = model or info.name
        elif model is None:
            raise RingStateError("a ring needs a model (exported with the plan) or an export_id")
        else:
            self.model_entry(model)
        served = self.served.put(ServedRing(ring_id, model, plan, spec, export_id, standby))
        job = self._add_ring(served, auto=False)
        return self.rings[ring_id], job

    def _rerun(self, ring: ServiceRing, *, auto: bool = False):
        if ring.phase is not RingPhase.FAILED:
            raise RingStateError(f"ring {ring.ring_id} is {ring.phase}; only a failed ring is re-run")
        self.figures.note_rebuild(ring.ring_id)
        return self._start_run(ring, "restore" if auto else "rerun")

    def rerun(self, ring_id: str):
        return self._rerun(self.ring(ring_id))

    def cancel_export(self, ring_id: str) -> ServiceRing:
        ring = self.ring(ring_id)
        ring.cancel_export()
        return ring

    async def async_stop_ring(self, ring_id: str) -> None:
        """Stop and forget a ring: out of the router (its streams finish), workers stopped."""
        ring = self.ring(ring_id)
        self._auto.pop(ring_id, None)
        self.served.remove(ring_id)
        await ring.async_stop(workers=True)
        self.rings.pop(ring_id, None)
        self.feed.publish(EventKind.RING_REMOVED, {"ring": ring_id})

    def service_json(self) -> dict[str, Any]:
        from engine import __version__

        s = self.settings.fleet
        hub = self.host.hub  # where agents register by address (their --seed)
        return {"fleet_id": self.fleet.fleet_id, "enrollment": self.host.enrollment, "version": __version__,
                "hub": f"{hub.host}:{hub.port}" if hub.port else None,
                "api_url": self.api_url, "started_at": self.started_at,
                "admin": {"socket": True, "https": self.admin_url},
                "settings": {"interface": s.interface, "runtime": s.runtime, "api_port": self.api.port}}


def _checkpoint_of(model: ModelEntry) -> Path:
    """The HF checkpoint directory behind a model (a GGUF is converted once, then cached)."""
    if model.kind == "hf" and model.path is not None:
        return model.path
    from export.sources import resolve_model

    return resolve_model(model.spec).checkpoint_dir


def run_fleet_service(settings: FleetServiceSettings) -> int:
    """Run the service until SIGINT/SIGTERM; the exit code."""

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):  # Windows: Ctrl-C raises KeyboardInterrupt
                loop.add_signal_handler(sig, stop.set)
        service = await FleetService.async_open(settings)
        print(f"deskfleet fleet: fleet {service.fleet.fleet_id}; PCs join at {service.host.enrollment}; "
              f"OpenAI API at {service.api_url}; admin socket {settings.state_dir / ADMIN_SOCKET}"
              f"{'; admin API ' + service.admin_url if service.admin_url else ''}", flush=True)
        try:
            await stop.wait()
        finally:
            await service.async_close()
        return 0

    return asyncio.run(main())
