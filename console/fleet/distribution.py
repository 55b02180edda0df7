"""Distribution: from an export and a ring layout to a running coordinator.

:meth:`Distributor.async_run` publishes the export on the console's hub, sends every agent its
:class:`~engine.control.messages.Assignment` (listen port, next hop = the next agent's data address, and
for the last stage the coordinator's return port), starts the fetches and polls the agents'
status, reporting each agent's bytes as :class:`~console.fleet_api.ring_status.AgentProgress`
(one agent's phases and their progress: :mod:`console.fleet.agent_phases`).
Once every agent holds verified files it starts the workers, connects the ring (stage 0 in this
process when the layout says so, mutual TLS with the console's fleet certificate) and checks it
with a one-token generation.

The ring is opened by :func:`engine.coordinator.ring_factory.open_ring`, which picks the runtime
from the export (:mod:`console.fleet.ring_runtime`): a CPU/GPU export serves **paged** (a
:class:`~engine.paged.coordinator.BatchCoordinator` over a block pool that the
tightest member's ``kv_pool_mb``, reported in its status, holds), an NPU-target export **static**
(a :class:`~engine.static.packed_generator.PackedGenerator` over the export's slots; every stage
on an agent, no failover beyond redialling its first stage).

Every agent is known by its certificate: the first contact learns its node id from the TLS
peer (or the layout names it), and every later call is pinned to it. The assignments carry
who each worker deals with — the previous stage's agent (the console for the first) as its
upstream, the next stage's agent (the console's return port for the last) as its next hop —
and the console's deny list; the hub serves each agent only its assigned stage's files, and the
coordinator's return port takes answers only from the last stage's agent.

A failure is data until the end of a phase: every agent gets its chance, then
:class:`AgentsFailedError` names each agent that failed and why. Running again resumes: agents
keep the files they verified (the agent's store remembers them), an unchanged assignment keeps a
running worker running, and the return port stays the same so the assignments do not change.

Once up, the ring fails over (:mod:`console.fleet.failover`): a stage that stops answering
(step timeout, or at once when its agent tells the hub it paused) comes back on its own agent or
moves to one of the ``standby`` agents while the coordinator holds and then replays every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from console.fleet.agent_phases import (
    DistributionTimeouts,
    ProgressBoard,
    async_fetch_shard,
    async_start_stage_worker,
)
from console.fleet.errors import (
    AgentFailure,
    AgentsFailedError,
    DistributionError,
    LayoutError,
    RingUnhealthyError,
)
from console.fleet.failover import FailoverSettings, RingRecovery
from console.fleet.failover_plan import moved_layout, spare_stages
from console.fleet.ring_layout import AgentEndpoint, AgentTarget, RingLayout
from console.fleet.ring_runtime import (
    PoolBudgetRefusedError,
    RingRuntime,
    pool_refusal,
    ring_pool_blocks,
    serves_paged,
)
from console.fleet_api.ring_status import AgentPhase, AgentProgress, RingHealth
from engine.control.client import ControlClient, ControlError
from engine.control.fleet_services import FleetHost
from engine.control.hub import AgentEvent
from engine.control.messages import AgentStatus, Assignment, ControlRequestError, WorkerSettings
from engine.coordinator.ring_factory import RingGenerator, RingOptions, open_ring, ring_path
from engine.errors import DeskfleetError
from engine.generation.request import GenerationRequest
from engine.paged.constraints import GrammarVocabulary
from engine.paged.coordinator import BatchCoordinator
from engine.paged.stage import PagedStage
from engine.ring.ends import RingEnds
from engine.shards.manifest import MANIFEST_NAME, load_manifest, serving_runtime
from engine.tasks import start_task
from engine.trust.peer_policy import PeerPolicy
from engine.wire.address import Address

log = logging.getLogger(__name__)


class Distributor:
    """Brings one export up on one ring of agents and keeps its coordinator until closed."""

    def __init__(self, host: FleetHost, export_dir: Path, layout: RingLayout, *, export_id: str | None = None,
                 console_host: str = "127.0.0.1", worker: WorkerSettings | None = None,
                 api_url: str | None = None, slots: int | None = None,
                 on_progress: Callable[[AgentProgress], None] | None = None,
                 timeouts: DistributionTimeouts | None = None, standby: Sequence[AgentEndpoint] = (),
                 data_hop: Callable[[Address], Awaitable[Address]] | None = None,
                 failover: FailoverSettings | None = None, runtime: RingRuntime | str = "paged",
                 return_port: int = 0) -> None:
        self.host = host
        self.export_dir = Path(export_dir)
        self.manifest = load_manifest(self.export_dir)
        layout.check(len(self.manifest.stages))
        self.layout = layout
        self.export_id = export_id or self.export_dir.name
        self.console_host = console_host
        self.worker = worker or WorkerSettings()
        self.api_url = api_url
        self.runtime = runtime if isinstance(runtime, RingRuntime) else RingRuntime(runtime, slots=slots)
        self.paged = serves_paged(self.runtime, self.manifest, self.worker)
        if not self.paged and layout.local_stage0:
            raise LayoutError("a static (NPU-target) ring runs every stage on an agent: the fleet service cannot "
                              "host its stage 0; re-plan the ring without a local stage 0")
        self.slots = self.runtime.slots_for(self.paged)
        self._pool_mb: dict[str, int] = {}  # control address -> the MiB its agent gives a paged pool
        self.pool_blocks = 0  # a paged ring's pool, fixed when its path opens
        self.timeouts = timeouts or DistributionTimeouts()
        self._board = ProgressBoard(self.manifest, on_progress or (lambda progress: None))
        self._manifest_json = (self.export_dir / MANIFEST_NAME).read_text(encoding="utf-8")
        self.failover = failover or FailoverSettings()  # read at each failure: may be replaced between them
        self.recovery = RingRecovery(self, standby)
        self._clients: dict[str, ControlClient] = {}
        self._quick: dict[str, ControlClient] = {}  # short-timeout clients for failover's status looks
        self._sent: dict[str, Assignment] = {}  # control address -> the assignment it last accepted
        # control address -> node id (from the certificate, or the layout): pins the control
        # clients, names the workers' peers and matches the hub's events
        self._node_ids: dict[str, str] = {t.control: t.node_id for t in layout.targets if t.node_id}
        self._unsubscribe: Callable[[], None] | None = None
        self._watch: asyncio.Task | None = None
        self._stage0: PagedStage | None = None
        self._path: RingEnds | None = None
        self._opened: RingGenerator | None = None  # opened with its path (open_ring), started by _async_connect
        # fixed by the first listen (or given: the fleet service's ring after a restart), so a re-run
        # sends the same assignments
        self._return_port = return_port
        # data_hop(address) -> the address to dial instead (e.g. a WAN emulator in front of it);
        # applied to the console's own hops: to the first agent, and the last agent's way back.
        self._data_hop = data_hop
        self._return_dial: Address | None = None
        self._first_address: Address | None = None  # the first remote stage's own address (before data_hop)
        self._coordinator: RingGenerator | None = None
        self._background: set[asyncio.Task] = set()
        for target in layout.targets:  # refuse here what an agent would refuse with a 400
            try:
                Assignment.from_dict(self._assignment(target, 1).to_dict())
            except ControlRequestError as exc:
                raise LayoutError(f"cannot assign stage {target.stage} to {target.label}: {exc}") from exc

    # -- what the caller sees ----------------------------------------------------------------------

    @property
    def coordinator(self) -> RingGenerator:
        """The running coordinator, to put the OpenAI API on (:func:`engine.api.server.async_run_api`)."""
        if self._coordinator is None:
            raise DistributionError("the ring is not up; run the distribution first")
        return self._coordinator

    @property
    def tokenizer_dir(self) -> Path:
        return self.export_dir / "tokenizer"

    def progress(self) -> tuple[AgentProgress, ...]:
        """The last progress of every agent, in stage order."""
        return self._board.progress(self.layout.targets)

    async def async_run(self) -> RingHealth:
        """Distribute, start and check the ring; a healthy RingHealth, or AgentsFailedError /
        RingUnhealthyError. Calling it again after a failure resumes where it stopped."""
        if self._coordinator is not None:
            return await self._async_checked()
        self.host.hub.publish(self.export_id, self.export_dir)
        await self._each(self._async_identify)
        if self.paged:
            if self._path is None:
                self.pool_blocks = 0  # a new ring: sized afresh from what every member gives now
            await self._each(self._async_learn_pool)
        path = await self._async_open_path()
        return_port = path.return_address.port
        await self._each(lambda t: self._async_fetch(t, self._assignment(t, return_port)))
        await self._each(self._async_start_worker)
        await self._async_connect(path)
        health = await self._async_checked()
        await self._async_hold_spares()  # once the ring answers: a spare's compile must not slow its first check
        return health

    async def async_health(self) -> RingHealth:
        """Every agent's worker state, and a one-token generation through the ring."""
        statuses = await asyncio.gather(*(self._async_status(t) for t in self.layout.targets))
        agents = []
        for target, status in zip(self.layout.targets, statuses, strict=True):
            if isinstance(status, AgentStatus):
                phase = AgentPhase.RUNNING if status.worker.state == "running" else AgentPhase.FAILED
                agents.append(self._board.report(target, phase, status, error=status.worker.last_error
                                           if phase is AgentPhase.FAILED else None))
            else:
                agents.append(self._board.report(target, AgentPhase.FAILED, error=status))
        if self._coordinator is None:
            return RingHealth(tuple(agents), self.layout.local_stage0, None, 0.0, "the ring is not up")
        started = time.perf_counter()
        try:
            token = await asyncio.wait_for(self._async_one_token(), self.timeouts.health_s)
        except (DeskfleetError, TimeoutError) as exc:
            return RingHealth(tuple(agents), self.layout.local_stage0, None, 0.0,
                              f"a one-token test generation failed: {exc or 'timed out'}")
        return RingHealth(tuple(agents), self.layout.local_stage0, token, 1000 * (time.perf_counter() - started))

    @property
    def return_port(self) -> int:
        """The coordinator's return port (0 until the ring's path first listened)."""
        return self._return_port

    async def async_close(self, *, stop_workers: bool = True) -> None:
        """Close the ring, then stop every agent's worker (an unreachable agent is logged).
        ``stop_workers=False`` leaves them running (the fleet service stopping to restart)."""
        coordinator, self._coordinator = self._coordinator, None
        path, self._path, self._opened = self._path, None, None
        await self._async_stop_watch()
        if coordinator is not None:
            await coordinator.async_stop()  # closes its path
        elif path is not None:
            await path.async_close()
        if stop_workers:
            await asyncio.gather(*(self._async_stop_worker(t) for t in self.layout.targets))

    async def __aenter__(self) -> Distributor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.async_close()

    # -- what failover does to the ring (console.fleet.failover.RecoverableRing) ---------------------

    async def async_agent_status(self, control: str, timeout: float) -> AgentStatus | str:
        """The status of the agent at ``control`` (HOST:PORT), or why it did not answer within
        ``timeout`` seconds; asked through a client of its own, pinned like :meth:`client`."""
        node_id = self._node_ids.get(control)
        quick = self._quick.get(control)
        if quick is None or quick.node_id != node_id:
            target = AgentTarget(control, 0)
            quick = self._quick[control] = ControlClient(self.host.credentials, target.host, target.port,
                                                         timeout=timeout, node_id=node_id)
        try:
            return await quick.async_status()
        except ControlError as exc:
            return str(exc)

    async def async_redial(self, path: RingEnds) -> None:
        """Every stage serves again: redial the first remote stage (the first agent's, stage 1 when
        the console hosts stage 0), through ``data_hop`` when it moved; the same hop otherwise."""
        first = self.layout.targets[0]
        address = Address(first.host, first.data_port)
        dial = None
        if address != self._first_address:
            dial = await self._data_hop(address) if self._data_hop is not None else address
            self._first_address = address
        await asyncio.wait_for(path.async_reconnect(dial), self.timeouts.dial_s + 5)

    async def async_move(self, layout: RingLayout, released: Sequence[AgentEndpoint]) -> tuple[AgentFailure, ...]:
        """Serve the same stages on ``layout`` (a failover moved some; LayoutError if it cannot).
        The ``released`` agents lost their stage: they stop serving it (a paused one must not
        restart it on resume, a crashed one not come back beside its replacement), beside the
        bring-up so an unreachable one holds nothing up. Every agent whose assignment changed is
        assigned, fetched and started; the failures (empty when all serve)."""
        layout.check(len(self.manifest.stages))
        lost = {t.control: t.stage for t in self.layout.targets}
        self.layout = layout
        for endpoint in released:
            self._forget_assignment(endpoint.control)
        releasing = asyncio.gather(*(self._async_release(e, lost[e.control]) for e in released))
        changed = tuple(t for t in layout.targets
                        if self._sent.get(t.control) != self._assignment(t, self._return_port))
        failures = await self._async_bring_up(changed)
        await releasing
        return failures

    def _forget_assignment(self, control: str) -> None:
        """The agent at ``control`` no longer serves its stage: the next assignment is sent anew,
        and until then the hub serves it none of this export's files."""
        self._sent.pop(control, None)
        node_id = self._node_ids.get(control)
        if node_id is not None:
            self.host.hub.grant(node_id, self.export_id, ())

    async def _async_release(self, endpoint: AgentEndpoint, stage: int) -> None:
        """Stop the agent serving ``stage``; it waits as a standby for it, keeping its warm spare
        (asked first, so that the stop leaves the spare running)."""
        await self._async_hold_spare(endpoint, stage)
        with contextlib.suppress(ControlError):
            await self.client(endpoint.control).async_stop_worker()

    # -- warm spares on the standbys ------------------------------------------------------------------

    async def _async_hold_spares(self) -> None:
        """Ask each standby to keep a warm spare of the stage it would most likely take
        (failover_plan.spare_stages); one that cannot (paused, short of memory, unreachable) is
        logged and stays a cold standby."""
        wanted = spare_stages(self.layout, self.recovery.standby)
        await asyncio.gather(*(self._async_hold_spare(e, wanted[e.control]) for e in self.recovery.standby))

    async def _async_hold_spare(self, endpoint: AgentEndpoint, stage: int) -> None:
        self.recovery.spares.pop(endpoint.control, None)
        layout, _ = moved_layout(self.layout, [(stage, endpoint)])
        target = next(t for t in layout.targets if t.stage == stage)
        if await self._async_identify(target) is not None:
            log.warning("standby %s: no warm spare (it did not answer as itself)", target.label)
            return
        client = self.client(endpoint.control)
        self.host.hub.grant(client.node_id or "", self.export_id, [stage])  # the spare may need to fetch
        try:
            await client.async_hold_spare(self._assignment(target, self._return_port, layout))
        except ControlError as exc:
            log.warning("standby %s holds no warm spare of stage %d: %s", target.label, stage, exc)
            return
        self.recovery.spares[endpoint.control] = stage

    async def _async_bring_up(self, targets: Sequence[AgentTarget]) -> tuple[AgentFailure, ...]:
        """Assign, fetch and start ``targets`` at once; the failures (empty when all serve)."""
        async def one(target: AgentTarget) -> AgentFailure | None:
            failure = await self._async_fetch(target, self._assignment(target, self._return_port))
            return failure or await self._async_start_worker(target)

        identified = await asyncio.gather(*(self._async_identify(t) for t in targets))
        if any(identified):
            return tuple(f for f in identified if f is not None)
        if self.paged:  # a new member's budget must hold the running ring's pool
            learned = await asyncio.gather(*(self._async_learn_pool(t) for t in targets))
            if any(learned):
                return tuple(f for f in learned if f is not None)
        if self._path is not None:
            await self._path.async_set_peers(self._ring_peers())
        results = await asyncio.gather(*(one(t) for t in targets))
        return tuple(r for r in results if r is not None)

    # -- assignments and phases ----------------------------------------------------------------------

    def client(self, control: str) -> ControlClient:
        """The control client of the agent at ``control`` (HOST:PORT), pinned to its node id once
        known (:meth:`_async_identify`)."""
        node_id = self._node_ids.get(control)
        if control not in self._clients or self._clients[control].node_id != node_id:
            target = AgentTarget(control, 0)
            self._clients[control] = ControlClient(self.host.credentials, target.host, target.port,
                                                   node_id=node_id)
        return self._clients[control]

    async def _async_identify(self, target: AgentTarget) -> AgentFailure | None:
        """Learn (or check) the agent's node id from its certificate, before anything is sent."""
        try:
            client = self.client(target.control)
            await client.async_probe()
        except ControlError as exc:
            return self._board.fail(target, str(exc))
        node_id = client.peer_node_id
        if node_id is None or node_id in self.host.hub.deny:
            return self._board.fail(target, "its certificate was revoked by the console (it was removed); re-plan "
                              "without it")
        self._node_ids[target.control] = node_id
        return None

    async def _async_learn_pool(self, target: AgentTarget) -> AgentFailure | None:
        """Learn the MiB the agent gives a paged stage's pool (and, once the ring's pool is fixed,
        check that it holds it)."""
        try:
            status = await self.client(target.control).async_status()
        except ControlError as exc:
            return self._board.fail(target, str(exc))
        if status.kv_pool_mb is None:
            return self._board.fail(target, "its agent reports no KV pool budget: it is too old to serve a paged ring; "
                              "update Deskfleet on that PC", status)
        self._pool_mb[target.control] = status.kv_pool_mb
        if self.pool_blocks:
            why = pool_refusal(self.manifest, self.worker, target.stage, target.label, status.kv_pool_mb,
                               self.pool_blocks)
            if why is not None:
                return self._board.fail(target, why, status)
        return None

    def _assignment(self, target: AgentTarget, return_port: int, layout: RingLayout | None = None) -> Assignment:
        targets = (layout or self.layout).targets
        index = targets.index(target)
        next_hop = targets[index + 1].data_address if index + 1 < len(targets) else \
            str(self._return_dial or Address(self.console_host, return_port))
        console = self.host.credentials.node_id
        upstream = self._node_ids.get(targets[index - 1].control) if index > 0 else console
        expect_next = self._node_ids.get(targets[index + 1].control) if index + 1 < len(targets) else console
        return Assignment.create(self._manifest_json, export_id=self.export_id, stage=target.stage,
                                 source=self.host.hub.shard_url(self.export_id), listen_port=target.data_port,
                                 next_hop=next_hop, worker=self.worker, api_url=self.api_url,
                                 api_key=self._member_key(target), events_url=self.host.hub.events_url,
                                 expect_upstream=(upstream,) if upstream else (), expect_next=expect_next,
                                 deny=tuple(sorted(self.host.hub.deny)),
                                 runtime=serving_runtime(self.manifest))

    def _member_key(self, target: AgentTarget) -> str | None:
        """The member's own limited key for its tray chat, never the console's (issue 29, M9)."""
        member_key = getattr(self.host, "member_key", None)
        return member_key(self._node_ids.get(target.control)) if member_key is not None else None

    async def _each(self, phase: Callable[[AgentTarget], Awaitable[object]]) -> None:
        """Run ``phase`` on every agent at once; AgentsFailedError naming all that failed."""
        results = await asyncio.gather(*(phase(t) for t in self.layout.targets))
        failures = tuple(r for r in results if isinstance(r, AgentFailure))
        if failures:
            for failure in failures:
                log.warning("distribution: %s (stage %d): %s", failure.agent, failure.stage, failure.message)
            raise AgentsFailedError(failures)

    async def _async_fetch(self, target: AgentTarget, assignment: Assignment) -> AgentFailure | None:
        client = self.client(target.control)
        try:
            self._board.report(target, AgentPhase.ASSIGNING)
            self.host.hub.grant(client.node_id or "", self.export_id, [target.stage])
            await client.async_assign(assignment)
            self._sent[target.control] = assignment
            return await async_fetch_shard(client, target, self.export_id, self._board, self.timeouts)
        except ControlError as exc:
            return self._board.fail(target, str(exc))

    async def _async_start_worker(self, target: AgentTarget) -> AgentFailure | None:
        try:
            return await async_start_stage_worker(self.client(target.control), target, self._board, self.timeouts)
        except ControlError as exc:
            return self._board.fail(target, str(exc))

    async def _async_stop_worker(self, target: AgentTarget) -> None:
        try:
            await self.client(target.control).async_stop_worker()
        except ControlError as exc:
            log.warning("could not stop the worker of %s: %s", target.label, exc)

    async def _async_status(self, target: AgentTarget) -> AgentStatus | str:
        try:
            return await self.client(target.control).async_status()
        except ControlError as exc:
            return str(exc)

    # -- the ring ------------------------------------------------------------------------------------

    async def _async_open_path(self) -> RingEnds:
        """The coordinator's path, listening on its return port (the last stage's next hop)."""
        if self._path is None:
            first = self.layout.targets[0]
            creds = self.host.credentials
            first_remote = self._first_address = Address(first.host, first.data_port)
            if self._data_hop is not None:
                first_remote = await self._data_hop(first_remote)
            ends = {"server_ssl": creds.server_context(), "client_ssl": creds.client_context(),
                    "dial_deadline": self.timeouts.dial_s, "peers": self._ring_peers()}
            stage0 = await self._async_paged_stage0() if self.paged else None
            failover = self.failover
            options = RingOptions(device=self.worker.device, exact=self.worker.exact, slots=self.slots,
                                  token_budget=self.runtime.token_budget, pool_blocks=self.pool_blocks or None,
                                  step_timeout_s=failover.step_timeout_s, hold_timeout_s=failover.coordinator_hold_s)
            self._opened = open_ring(self.manifest, first_remote, Address(self.console_host, self._return_port),
                                     options=options, local_stage0=stage0,
                                     grammar=GrammarVocabulary.of_export(self.export_dir, self.manifest),
                                     recover=self.recovery.async_recover, **ends)  # type: ignore[arg-type]
            self._path = ring_path(self._opened)
            await self._path.async_listen()
            self._return_port = self._path.return_address.port
            if self._data_hop is not None:
                self._return_dial = await self._data_hop(Address(self.console_host, self._return_port))
        return self._path

    async def _async_paged_stage0(self) -> PagedStage | None:
        """Fix the paged ring's pool (the fewest blocks any member's budget holds) and, when the
        console hosts stage 0, load it paged with that pool."""
        budgets = [(t.stage, t.label, self._pool_mb[t.control]) for t in self.layout.targets]
        local_mb = self.runtime.stage0_kv_pool_mb
        if self.layout.local_stage0:
            budgets.append((0, "the console", local_mb))
        try:
            self.pool_blocks = ring_pool_blocks(self.manifest, self.worker, budgets)
        except PoolBudgetRefusedError as exc:
            raise LayoutError(str(exc)) from exc
        if not self.layout.local_stage0:
            return None
        stage0 = self._stage0
        if not isinstance(stage0, PagedStage):
            stage0 = self._stage0 = await asyncio.to_thread(
                PagedStage, self.export_dir, 0, device=self.worker.device, exact=self.worker.exact,
                num_threads=self.worker.threads, manifest=self.manifest)
        if stage0.pool_blocks != self.pool_blocks:
            await asyncio.to_thread(stage0.allocate, self.pool_blocks, local_mb << 20)
        return stage0

    def _ring_peers(self) -> PeerPolicy:
        """The coordinator's ends of the ring: replies only from the last stage's agent, steps only
        to the first agent's worker; the deny list on both."""
        targets = self.layout.targets
        last, first = self._node_ids.get(targets[-1].control), self._node_ids.get(targets[0].control)
        return PeerPolicy.of((last,) if last else (), first, self.host.hub.deny)

    async def _async_connect(self, path: RingEnds) -> None:
        coordinator = self._opened
        assert coordinator is not None and ring_path(coordinator) is path, "the ring is opened with its path"
        try:
            await asyncio.wait_for(coordinator.async_start(), self.timeouts.dial_s + 5)
        except (DeskfleetError, OSError, TimeoutError) as exc:
            await self._async_drop(coordinator)
            first = self.layout.targets[0]
            raise RingUnhealthyError(f"the console could not connect to stage {first.stage} on {first.label} at "
                                     f"{first.data_address} ({exc!r}); check that nothing blocks the port and "
                                     "run the distribution again") from exc
        self._coordinator = coordinator
        unsubscribe_events = self.host.hub.subscribe(self._on_hub_event)
        unsubscribe_deny = self.host.hub.subscribe_deny(self._on_deny)

        def unsubscribe() -> None:
            unsubscribe_events()
            unsubscribe_deny()

        self._unsubscribe = unsubscribe
        if isinstance(coordinator, BatchCoordinator):  # failover is the paged runtime's (a static ring redials)
            self._watch = start_task(self.recovery.async_watch(coordinator), name="deskfleet-ring-watch", logger=log)

    async def _async_stop_watch(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    def _on_hub_event(self, event: AgentEvent) -> None:
        """An agent of the ring paused, or its worker died: fail over now rather than at the ring
        watch's next look or the next step timeout."""
        coordinator = self._coordinator
        if event.event not in ("paused", "worker-lost") or not isinstance(coordinator, BatchCoordinator):
            return
        for target in self.layout.targets:
            if self._node_ids.get(target.control) == event.node_id:
                if event.event == "worker-lost":
                    why = f"{target.label} (stage {target.stage}) lost its worker: {event.body.get('detail')}"
                else:
                    reasons = ", ".join(event.body.get("reasons") or ()) or "no reason given"
                    why = f"{target.label} (stage {target.stage}) paused: {reasons}"
                coordinator.request_failover(why)
                return

    def _on_deny(self, deny: frozenset[str]) -> None:
        """The admin removed a member: the return port refuses it from now on."""
        if self._path is not None:
            start_task(self._path.async_set_peers(self._ring_peers()), name="deskfleet-ring-set-peers", logger=log,
                       keep=self._background)

    async def _async_drop(self, coordinator: RingGenerator) -> None:
        """Forget a broken ring (its path is closed); the next run opens a new one on the same port."""
        self._coordinator, self._path, self._opened = None, None, None
        await self._async_stop_watch()
        with contextlib.suppress(DeskfleetError, OSError):
            await coordinator.async_stop()

    async def _async_one_token(self) -> int:
        prompt = (self.manifest.model.bos_token_id or 0,)
        request = GenerationRequest(prompt, 1, ignore_eos=True)
        async with contextlib.aclosing(self.coordinator.stream(request)) as events:
            tokens = [event.token_id async for event in events]
        if len(tokens) != 1:
            raise DistributionError(f"the ring answered {len(tokens)} tokens to a one-token request")
        return tokens[0]

    async def _async_checked(self) -> RingHealth:
        health = await self.async_health()
        if not health.ok:
            if self._coordinator is not None:
                await self._async_drop(self._coordinator)
            failing = [f"{a.agent}: {a.phase} ({a.error})" for a in health.agents if a.phase is not AgentPhase.RUNNING]
            raise RingUnhealthyError(f"the ring is not healthy: {health.error or '; '.join(failing)}. "
                                     "Run the distribution again to rebuild it.")
        return health
