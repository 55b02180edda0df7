"""The headless agent: joins a fleet, advertises the PC, takes an assignment, fetches and verifies
its shard, supervises the stage worker, and steps aside when the person at the PC needs it.

One asyncio loop. The decisions are pure (:mod:`agent.service.pause`, :mod:`engine.control.messages`);
this class holds the state, does the I/O around them, and tells whoever listens (the tray, the
mDNS advertiser, the fleet service) when something changed. Everything the fleet service asked for is
persisted in the state dir, so a restarted agent goes back to serving what it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
from aiohttp import web

from agent.service import pause
from agent.service.calibration import async_time_stages, parse_calibration_request
from agent.service.control_api import build_app
from agent.service.fleet_link import (
    async_join_found_service,
    async_register_with_seeds,
    async_tell_service,
)
from agent.service.machine_load import LoadMeter, fresh_inventory
from agent.service.pc_facts import async_collect_inventory, battery_on_ac
from agent.service.settings import AgentSettings, AgentState, load_state, save_settings, save_state
from agent.service.spare_policy import SpareDecision
from agent.service.standby_spare import StandbySpare
from agent.service.store import ShardStore, async_fetch
from agent.service.supervisor import WorkerLaunch, WorkerSupervisor
from agent.service.worker_launch import memory_free_now, memory_refusal, spare_decision_now, stage_worker_launch
from engine import __version__
from engine.control.enrollment import async_join
from engine.control.links import LinkMeasurement, async_measure_link
from engine.control.messages import (
    AgentStatus,
    Assignment,
    ControlRequestError,
    FetchProgress,
    WorkerStatus,
)
from engine.discovery.advertisement import AgentState as RunState  # not the state file's AgentState
from engine.discovery.join_service import async_find_consoles
from engine.discovery.mdns import Advertisement, Advertiser, instance_name
from engine.errors import DeskfleetError
from engine.http_limits import LimitedAppRunner, LimitedSite
from engine.machine.this_pc import primary_ipv4
from engine.tasks import start_task
from engine.trust.fleet_ca import Credentials
from engine.trust.keystore import KeyStore

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 0.25  # while a worker runs: a keystroke must free its cores within 2 s
IDLE_MONITOR_INTERVAL_S = 1.0  # while nothing is to be served, a slower poll keeps the agent's own cost down
REGISTER_INTERVAL_S = 30.0
WORKER_READY_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 30.0
PAUSE_STOP_S = 1.0


class AgentService:
    """Implements :class:`~agent.service.control_api.ControlledAgent`, what its control API calls.
    ``idle_source`` and ``power`` are seams: tests pass a fake idle clock; the tray passes the real one."""

    def __init__(self, state_dir: Path, settings: AgentSettings, *, idle_source=None,
                 power: Callable[[], bool | None] = battery_on_ac, inventory: Callable[[], dict] | None = None,
                 clock: Callable[[], dt.datetime] = dt.datetime.now) -> None:
        self.state_dir = state_dir
        self.settings = settings
        self.store = ShardStore(state_dir / "shards")
        self.keystore = KeyStore(f"agent-{settings.instance}")
        self._idle = idle_source
        self._power = power
        self._clock = clock
        self._inventory_fn = inventory
        self._inventory: dict = {}
        self._state: AgentState = load_state(state_dir)
        self._creds: Credentials | None = None
        self._pause = pause.PauseState()
        self._fetch = FetchProgress()
        self._load = LoadMeter()
        self._fetch_task: asyncio.Task | None = None
        self._supervisor = WorkerSupervisor(on_change=self._on_worker)
        self._runner: web.AppRunner | None = None
        self._control_port: int | None = None
        self._advertiser: Advertiser | None = None
        self._monitor: asyncio.Task | None = None
        self._registrar: asyncio.Task | None = None
        self.interface = settings.interface or primary_ipv4()
        self._listeners: list[Callable[[AgentStatus], None]] = []
        self._standby_spare = StandbySpare(self._supervisor, launch=self._worker_launch, fetch=self._async_fetch_spare)
        self.spare = SpareDecision(False, "no worker yet")
        self._worker_restarts = 0  # whether the serving worker has a spare, and why
        self._last_state: str | None = None
        self._background: set[asyncio.Task] = set()
        self.last_pause_change: float | None = None  # monotonic time the pause state last flipped

    # ---- lifecycle -------------------------------------------------------------------------

    async def async_start(self) -> None:
        self._creds = self.keystore.load()
        self._inventory = await self._async_collect_inventory()
        if self._creds is not None:
            await self._async_open_control()
        self._advertiser = Advertiser(self.interface)
        await self._advertiser.async_start(self.advertisement())
        self._pause = self._decide()
        self._monitor = start_task(self._async_monitor(), name="deskfleet-agent-monitor", logger=log)
        if self.settings.seeds:
            self._registrar = start_task(self._async_register_loop(), name="deskfleet-agent-register", logger=log)
        if self._state.serving and self.assignment is not None and not self._pause.paused:
            with contextlib.suppress(DeskfleetError):
                await self._async_launch_worker()
        self._changed()

    async def async_close(self) -> None:
        for task in (self._monitor, self._registrar):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._fetch_task is not None:
            self._fetch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._fetch_task
        advertiser, self._advertiser = self._advertiser, None  # no re-announcements from here on
        for task in list(self._background):
            task.cancel()
        await self._standby_spare.async_drop()  # a standby spare still on its way must not start now
        await self._supervisor.async_stop()
        if advertiser is not None:
            await advertiser.async_close()
        await self._async_close_control()

    def subscribe(self, listener: Callable[[AgentStatus], None]) -> None:
        """``listener(status)`` after every change (called on the service's loop)."""
        self._listeners.append(listener)

    # ---- trust -------------------------------------------------------------------------------

    @property
    def joined(self) -> bool:
        return self._creds is not None

    @property
    def fleet_ca_pem(self) -> bytes | None:
        """The fleet CA this PC joined (what its chat trusts for the fleet's https API); None before a join."""
        return self._creds.ca_pem if self._creds is not None else None

    async def async_find_consoles(self, *, pin: str | None = None, timeout: float = 4.0):
        """The fleet services advertising their enrollment address on this agent's interface (mDNS)."""
        return await async_find_consoles(self.interface, pin=pin, timeout=timeout)

    async def async_join(self, console: str | None, token: str, *, timeout: float = 15.0) -> Credentials:
        """Redeem a join token at the fleet service's enrollment address; keep the key in the keyring.

        With no ``console`` the address is found over mDNS: the fleet services whose record names the
        token's fleet, tried in turn (the join itself checks the CA against the token's pin).
        """
        if console:
            joined = await async_join(console, token, self.settings.name, info=self._inventory, timeout=timeout)
        else:
            joined = await async_join_found_service(self.interface, token, self.settings.name, self._inventory,
                                                    timeout)
        creds = joined.credentials
        self.keystore.save(creds)
        self._creds = creds
        # the one place the pinned fleet service is (re)written: a fresh join through a service-role peer
        self._save(replace(self._state, service_node_id=joined.console_node_id, chat_key=joined.api_key))
        await self._async_close_control()
        await self._async_open_control()
        log.info("joined fleet %s as node %s", creds.fleet_id, creds.node_id[:16])
        self._changed()
        if self.settings.seeds:
            await self.async_register()
        return creds

    async def async_leave(self) -> None:
        """Forget the fleet: stop serving, delete the credentials and the assignment."""
        await self.async_drop_spare()
        await self._supervisor.async_stop()
        await self._async_close_control()
        self.keystore.delete()
        self._creds = None
        self._save(AgentState())  # forgets the pinned fleet service too: only a fresh join sets it again
        self._changed()

    # ---- control (called by the control API and the tray) -----------------------------------

    @property
    def assignment(self) -> Assignment | None:
        return None if self._state.assignment is None else Assignment.from_dict(self._state.assignment)

    async def async_assign(self, assignment: Assignment) -> None:
        """Store an assignment. One that changes only who the worker deals with (a failover moved
        a neighbour, a new deny list) goes to the running worker as a policy update; any other
        change stops the worker and the fetch (the fleet service fetches and starts again)."""
        current = self.assignment
        deny = tuple(sorted(set(assignment.deny) - {self._state.service_node_id}))
        if current is not None and current.same_stage(assignment) and self._supervisor.running:
            self._save(replace(self._state, assignment=assignment.to_dict(), deny=deny,
                               api_url=assignment.api_url or self._state.api_url))
            if not await self._supervisor.async_update_policy(assignment.peer_policy_json()):
                await self._async_launch_worker()
            self._changed()
            return
        if current is not None and current != assignment:
            await self._supervisor.async_stop(keep_spare=True)  # the next start may promote it
            if self._fetch_task is not None:
                self._fetch_task.cancel()
        self._fetch = FetchProgress(total_bytes=sum(e.size for e in assignment.files()))
        self._save(replace(self._state, assignment=assignment.to_dict(), serving=False, deny=deny,
                           api_url=assignment.api_url or self._state.api_url))
        self._changed()

    @property
    def service_node_id(self) -> str | None:
        """The fleet service this agent takes orders from (pinned at the join)."""
        return self._state.service_node_id

    @property
    def chat_key(self) -> str | None:
        """This PC's own API key for its tray's chat, received at the join (None: an older console's)."""
        return self._state.chat_key

    @property
    def deny(self) -> frozenset[str]:
        """Node ids the fleet service revoked: refused by the control API and the worker."""
        return frozenset(self._state.deny)

    async def async_set_deny(self, deny: tuple[str, ...], *, api_key: str | None = None) -> None:
        """Take the fleet service's new deny list (``POST /v1/deny``): kept, and given to the worker;
        ``api_key``, the API's key after the removal rotated it, replaces the assignment's (the
        tray's chat sends it)."""
        deny = tuple(sorted(set(deny) - {self._state.service_node_id}))  # never lock out the pinned fleet service
        assignment = self.assignment
        state = replace(self._state, deny=deny)
        if assignment is not None:
            assignment = replace(assignment, deny=deny, api_key=api_key or assignment.api_key)
            state = replace(state, assignment=assignment.to_dict())
        self._save(state)
        if assignment is not None and self._supervisor.running:
            if not await self._supervisor.async_update_policy(assignment.peer_policy_json()):
                await self._async_launch_worker()
        self._changed()  # the tray re-reads the assignment (its chat's key)
        log.info("the fleet service's deny list now holds %d member(s)", len(deny))

    async def async_set_fleet_api(self, api_url: str) -> None:
        """The fleet's OpenAI API address (``POST /v1/fleet-api``, when the admin approves this PC):
        kept, so the tray's chat opens before this PC is given any part of a model."""
        if api_url != self._state.api_url:
            self._save(replace(self._state, api_url=api_url))
            self._changed()
            log.info("the fleet's chat address is %s", api_url)

    async def async_begin_fetch(self, bandwidth_cap: int | None = None) -> None:
        assignment = self._require_assignment()
        if self._fetch_task is not None and not self._fetch_task.done():
            return  # already fetching: the status shows its progress
        self.store.check_space(assignment)  # 507 now rather than a failure in the background
        self._check_memory(assignment)
        cap = bandwidth_cap or self.settings.bandwidth_cap_bytes_s
        self._fetch = replace(self._fetch, error=None, finished=False)
        self._fetch_task = start_task(self._async_fetch(assignment, cap), name="deskfleet-fetch", logger=log)
        self._changed()

    async def async_wait_fetched(self, timeout: float) -> FetchProgress:
        if self._fetch_task is not None:
            await asyncio.wait_for(asyncio.shield(self._fetch_task), timeout)
        return self._fetch

    async def async_start_worker(self) -> None:
        assignment = self._require_assignment()
        if self.store.missing(assignment):
            raise ControlRequestError("the shard is not fetched and verified yet: POST /v1/fetch first", 409)
        self._check_memory(assignment)
        self._save(replace(self._state, serving=True))
        if self._pause.paused:
            self._changed()  # it starts when the pause ends
            return
        await self._async_launch_worker()

    async def async_stop_worker(self, *, drain: bool = False) -> None:
        """Stop serving; the warm spare stays only when the fleet service asked this agent to hold one
        (it lost its stage in a failover and waits as a standby for it)."""
        self._save(replace(self._state, serving=False))
        if drain:
            await self._supervisor.async_drain(DRAIN_TIMEOUT_S)
        else:
            await self._supervisor.async_stop(keep_spare=self._standby_spare.wanted is not None)
        if self._standby_spare.wanted is None:
            await self._supervisor.async_stop_spare()
        self._changed()

    # ---- warm spare (a standby's, POST /v1/spare) ------------------------------------------------

    async def async_hold_spare(self, assignment: Assignment) -> None:
        """Keep a warm spare for the stage ``assignment`` describes (a standby's: the stage the
        console would move here): fetch its files if missing, then compile it in a worker that
        does not listen (a paused PC starts it when the pause ends). The assignment itself is
        not taken; a later assignment of that stage promotes the spare. 409 while serving another
        stage or when the memory does not allow it."""
        if self._creds is None:
            raise ControlRequestError("join a fleet first", 409)
        current = self.assignment
        if self._supervisor.running and current is not None and not (
                current.export_id == assignment.export_id and current.stage == assignment.stage):
            raise ControlRequestError(f"this agent serves {current.export_id} stage {current.stage}; a spare for "
                                      f"another stage would only take its memory", 409)
        decision = self._spare_decision(assignment, worker_running=False)
        if not decision.keep:
            raise ControlRequestError(f"holding no spare: {decision.why}", 409)
        self.store.check_space(assignment)
        await self._standby_spare.async_hold(assignment, paused=self._pause.paused)

    async def async_drop_spare(self) -> None:
        """Hold no standby spare (the serving worker's own spare, if any, stays)."""
        await self._standby_spare.async_drop()

    @property
    def spare_pid(self) -> int | None:
        """The warm spare's process id (None: none)."""
        return self._supervisor.spare_pid

    @property
    def spare_ready(self) -> bool:
        """A warm spare is compiled and waiting."""
        return self._supervisor.spare_ready

    @property
    def worker_starts(self) -> tuple[dict, ...]:
        """How the last workers came up (wall-clock times; see WorkerSupervisor.starts)."""
        return tuple(self._supervisor.starts)

    async def _async_fetch_spare(self, assignment: Assignment) -> None:
        if self.store.missing(assignment):
            await async_fetch(self.store, assignment, ssl=self._creds.client_context() if self._creds else None,
                              service_node_id=self._state.service_node_id)

    def _spare_decision(self, assignment: Assignment, *, worker_running: bool) -> SpareDecision:
        return spare_decision_now(self.settings.warm_spare, assignment, kv_pool_mb=self.kv_pool_mb,
                                  worker_running=worker_running)

    async def async_wait_worker_ready(self, timeout: float = WORKER_READY_TIMEOUT_S) -> None:
        await self._supervisor.async_wait_ready(timeout)

    async def async_set_manual_pause(self, paused: bool) -> None:
        self._save(replace(self._state, manually_paused=paused))
        await self._async_apply(self._decide())

    async def async_set_remote_pause(self, paused: bool) -> None:
        self._save(replace(self._state, remotely_paused=paused))
        await self._async_apply(self._decide())

    async def async_measure_link(self, host: str, port: int, *, samples: int = 5, nbytes: int = 1 << 20,
                                 node_id: str | None = None) -> LinkMeasurement:
        """This PC's link to another agent's control API (for placement's agent -> agent latencies);
        ``node_id``: the agent that must answer there."""
        if self._creds is None:
            raise ControlRequestError("join a fleet first", 409)
        return await async_measure_link(f"https://{host}:{port}", self._creds.client_context(),
                                        samples=samples, nbytes=nbytes, node_id=node_id)

    async def async_calibrate(self, body: dict) -> list[dict]:
        """Fetch the named stages of a calibration export and time a decode step of each on the
        requested device, in a subprocess (see :mod:`agent.service.calibration`)."""
        if self._pause.paused:
            raise ControlRequestError(f"paused ({', '.join(self._pause.reasons)}): not calibrating now", 409)
        request = parse_calibration_request(body)
        ssl = self._creds.client_context() if self._creds else None
        for part in request.parts:
            await async_fetch(self.store, part, ssl=ssl, service_node_id=self._state.service_node_id)
        return await async_time_stages(self.store.directory(request.parts[0].export_id), request)

    async def async_update_settings(self, **changes) -> AgentSettings:
        """Change settings (validated, saved atomically) and re-decide the pause at once."""
        settings = replace(self.settings, **changes)
        await asyncio.to_thread(save_settings, self.state_dir, settings)
        self.settings = settings
        await self._async_apply(self._decide())
        return settings

    # ---- status ------------------------------------------------------------------------------

    @property
    def control_port(self) -> int | None:
        return self._control_port

    @property
    def worker_pid(self) -> int | None:
        return self._supervisor.pid

    def state(self) -> RunState:
        worker = self._supervisor.status
        if self._creds is None:
            return RunState.NOT_JOINED
        if worker.state == "failed" or self._fetch.error:
            return RunState.ERROR
        if self._pause.paused:
            return RunState.PAUSED
        if self._fetch_task is not None and not self._fetch_task.done():
            return RunState.FETCHING
        if worker.state in ("starting", "running", "backoff"):
            return RunState.SERVING
        return RunState.IDLE

    def status(self) -> AgentStatus:
        assignment = self.assignment
        creds = self._creds
        worker = self._supervisor.status
        fetch_error = self._fetch.error
        load = self._load.sample()
        return AgentStatus(
            node_id=creds.node_id if creds else "", fleet_id=creds.fleet_id if creds else "",
            name=self.settings.name, version=__version__, state=self.state(),
            paused_reasons=self._pause.reasons, inventory=fresh_inventory(self._inventory, self.store.root),
            export_id=assignment.export_id if assignment else None, stage=assignment.stage if assignment else None,
            fetch=self._fetch, worker=worker if not fetch_error else replace(worker, last_error=fetch_error),
            api_url=self._state.api_url, kv_pool_mb=self.kv_pool_mb, tags=self.settings.tags,
            cpu_percent=load.cpu_percent, memory_used_bytes=load.memory_used_bytes,
            hop_bytes_sent=self._supervisor.hop_bytes_sent)

    @property
    def kv_pool_mb(self) -> int:
        """The MiB this PC gives a paged stage's KV block pool (its setting, capped by its RAM)."""
        return self.settings.kv_pool_budget_mb(psutil.virtual_memory().total)

    def probe(self) -> dict:
        creds = self._creds
        return {"node_id": creds.node_id if creds else "", "fleet_id": creds.fleet_id if creds else "",
                "name": self.settings.name, "version": __version__, "state": self.state(),
                "control_port": self._control_port}

    def advertisement(self) -> Advertisement:
        creds = self._creds
        devices = tuple(d["name"] for d in self._inventory.get("devices", ()))
        return Advertisement(
            instance=instance_name(self.settings.name, self.settings.instance), node_id=creds.node_id if creds else "",
            fleet_id=creds.fleet_id if creds else "", version=__version__, devices=devices,
            memory_bytes=int(self._inventory.get("ram_total", 0)), state=self.state(),
            control_port=self._control_port or 0,
            addresses=(self.interface,))

    # ---- internals ---------------------------------------------------------------------------

    async def _async_collect_inventory(self) -> dict:
        """The PC's inventory (the ``inventory`` seam's when given)."""
        if self._inventory_fn is not None:
            return self._inventory_fn()
        return await async_collect_inventory(self.store.root)

    def _require_assignment(self) -> Assignment:
        assignment = self.assignment
        if assignment is None:
            raise ControlRequestError("this agent has no assignment yet: POST /v1/assign first", 409)
        return assignment

    def _save(self, state: AgentState) -> None:
        save_state(self.state_dir, state)
        self._state = state

    async def _async_open_control(self) -> None:
        assert self._creds is not None
        app = build_app(self)
        self._runner = LimitedAppRunner(app, access_log=None, handler_cancellation=True, what="control API")
        await self._runner.setup()
        site = LimitedSite(self._runner, self.interface, self.settings.control_port,
                           ssl_context=self._creds.server_context())
        await site.start()
        self._control_port = self._runner.addresses[0][1]
        log.info("control API on https://%s:%d", self.interface, self._control_port)

    async def _async_close_control(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._control_port = None

    async def _async_fetch(self, assignment: Assignment, cap: int | None) -> None:
        def progress(p: FetchProgress) -> None:
            self._fetch = p

        try:
            await async_fetch(self.store, assignment, ssl=self._creds.client_context() if self._creds else None,
                              on_progress=progress, bandwidth_cap=cap, service_node_id=self._state.service_node_id)
            self.store.prune(keep=assignment.export_id)
        except asyncio.CancelledError:
            raise
        except (DeskfleetError, OSError) as exc:
            log.warning("shard fetch failed: %s", exc)
            self._fetch = replace(self._fetch, error=str(exc), finished=False)
        finally:
            self._changed()

    async def _async_launch_worker(self) -> None:
        assignment = self._require_assignment()
        launch = self._worker_launch(assignment)
        self._standby_spare.taken(assignment)  # a standby taking its spared stage: the spare is promoted
        self.spare = self._spare_decision(assignment, worker_running=self._supervisor.running)
        self._supervisor.want_spare = self.spare.keep
        await self._supervisor.async_start(launch)

    def _check_memory(self, assignment: Assignment) -> None:
        """Refuse (HTTP 507) a stage this PC's free memory cannot hold, before it is fetched or loaded;
        not while a worker or a spare of it runs (its memory is already taken)."""
        if self._supervisor.running or self._supervisor.spare_pid is not None:
            return
        free, total = memory_free_now()
        why = memory_refusal(assignment, kv_pool_mb=self.kv_pool_mb, available_bytes=free, total_bytes=total)
        if why is not None:
            log.warning("refused: %s", why)
            raise ControlRequestError(why, 507)

    def _worker_launch(self, assignment: Assignment) -> WorkerLaunch:
        creds = self._creds
        if creds is None:
            raise ControlRequestError("join a fleet before serving", 409)
        port = assignment.listen_port or self.settings.data_port
        return stage_worker_launch(creds, assignment, listen=f"{self.interface}:{port}",
                                   shard_dir=self.store.directory(assignment.export_id),
                                   cache_dir=self.state_dir / "compiled", kv_pool_mb=self.kv_pool_mb)

    def _on_worker(self, status: WorkerStatus) -> None:
        if status.restarts > self._worker_restarts:  # it died under load: the fleet service fails over now
            start_task(self._async_notify("worker-lost", status.last_error), name="deskfleet-notify-worker-lost",
                       logger=log, keep=self._background)
        self._worker_restarts = status.restarts
        self._changed()

    def _decide(self) -> pause.PauseState:
        idle_s = self._idle.seconds_since_input() if self._idle is not None else None
        obs = pause.Observation(idle_s, self._power(), self._clock())
        return pause.decide(self.settings, obs, self._pause, manual=self._state.manually_paused,
                            remote=self._state.remotely_paused)

    async def _async_apply(self, decision: pause.PauseState) -> None:
        was = self._pause.paused
        self._pause = decision
        if decision.paused and not was:
            self.last_pause_change = time.monotonic()
            log.info("pausing: %s", ", ".join(decision.reasons))
            # SIGTERM: the frame in hand finishes; a worker that takes longer than PAUSE_STOP_S is
            # killed, since the person comes first and the coordinator replays whatever was lost.
            await self._supervisor.async_stop(PAUSE_STOP_S)
            await self._async_notify("paused")
        elif was and not decision.paused:
            self.last_pause_change = time.monotonic()
            log.info("resuming")
            if self._state.serving and self.assignment is not None:
                await self._async_launch_worker()
            else:
                await self._standby_spare.async_resume()
            await self._async_notify("resumed")
        self._changed()

    async def _async_monitor(self) -> None:
        while True:
            busy = self._supervisor.running or self._state.serving  # serving, or paused from serving
            await asyncio.sleep(MONITOR_INTERVAL_S if busy else IDLE_MONITOR_INTERVAL_S)
            try:
                decision = self._decide()
                if decision != self._pause:
                    await self._async_apply(decision)
            except Exception:  # a broken idle source must not stop the pause loop for good
                log.exception("pause monitor step failed")

    async def _async_notify(self, event: str, detail: str | None = None) -> None:
        """Tell the fleet service (best effort) so it can hold or move the streams this stage served."""
        assignment, creds = self.assignment, self._creds
        if assignment is not None and assignment.events_url is not None and creds is not None:
            await async_tell_service(assignment, creds, self._state.service_node_id, event,
                                     self._pause.reasons, detail)

    async def async_register(self) -> int:
        """Register with every seed fleet service by address (networks that drop multicast); returns how
        many accepted. Needs the fleet certificate: the seed's hub is mutual TLS like the rest."""
        if self._creds is None:
            return 0
        body = {"advertisement": self.advertisement().to_properties(), "control_port": self._control_port,
                "address": self.interface, "tags": list(self.settings.tags)}
        return await async_register_with_seeds(self._creds, self._state.service_node_id, self.settings.seeds, body)

    async def _async_register_loop(self) -> None:
        while True:
            await self.async_register()
            await asyncio.sleep(REGISTER_INTERVAL_S)

    def _changed(self) -> None:
        status = self.status()
        if self._advertiser is not None and status.state != self._last_state:
            self._last_state = status.state
            start_task(self._advertiser.async_update(self.advertisement()), name="deskfleet-advert-update",
                       logger=log, keep=self._background)
        for listener in list(self._listeners):
            try:
                listener(status)
            except Exception:
                log.exception("status listener failed")
