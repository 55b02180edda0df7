"""The simulated fleet's controller: join tokens from the service's admin API, worker processes
of fake agents (:mod:`tests.support.sim_fleet.worker`), approvals, and what the workers report.

See the package docstring for the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from console.fleet_api.admin_client import AdminApiError, AdminClient
from console.shared.loop_thread import LoopThread

REGISTER_INTERVAL_S = 30.0  # agent.service.service.REGISTER_INTERVAL_S (not imported: it pulls in the worker stack)
AGENTS_PER_PROCESS = 250
REPO = Path(__file__).resolve().parents[3]


class SimFleetError(RuntimeError):
    """The simulated fleet could not start (a worker died, agents did not join or register in time)."""


@dataclass
class SimStats:
    """What the workers reported so far (times in seconds)."""

    joined: dict[str, str] = field(default_factory=dict)  # name -> node id
    join_s: list[float] = field(default_factory=list)
    join_failed: dict[str, str] = field(default_factory=dict)
    registered: list[float] = field(default_factory=list)  # every registration's round trip at the hub
    register_failed: int = 0
    polls: dict[int, int] = field(default_factory=dict)  # worker -> status polls its agents answered
    flaps: dict[int, int] = field(default_factory=dict)  # worker -> local pauses / resumes told to the hub
    paused: dict[int, list[str]] = field(default_factory=dict)  # worker -> names of its agents paused now
    remote: list[tuple[str, bool]] = field(default_factory=list)  # (name, paused) the service ordered
    errors: list[str] = field(default_factory=list)
    token_s: float = 0.0  # issuing the join tokens through the admin API
    approve_s: float = 0.0  # approving every agent through the admin API (reusable: waiting for auto-approval)
    join_wall_s: float = 0.0  # from starting the workers to every agent joined and registered once

    @property
    def total_polls(self) -> int:
        return sum(self.polls.values())

    @property
    def total_flaps(self) -> int:
        return sum(self.flaps.values())

    @property
    def total_paused(self) -> int:
        return sum(len(names) for names in self.paused.values())

    @property
    def paused_names(self) -> set[str]:
        """The agents paused now (locally or by the service), as of the workers' last reports."""
        return {name for names in self.paused.values() for name in names}


class _Worker:
    def __init__(self, index: int, proc: asyncio.subprocess.Process) -> None:
        self.index, self.proc = index, proc
        self.ready = asyncio.get_running_loop().create_future()
        self.stopped = asyncio.Event()
        self.reader: asyncio.Task | None = None

    def send(self, **cmd) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())


def _admin_client(admin: AdminClient | str | os.PathLike[str]) -> tuple[AdminClient, bool]:
    if isinstance(admin, AdminClient):
        return admin, False
    path = Path(admin)
    return AdminClient.over_socket(path / "admin.sock" if path.is_dir() else path), True


class SimFleet:
    """``agents`` fake agents in worker processes, joined to the service behind ``admin`` (an
    :class:`AdminClient`, the service's state dir, or its admin socket)."""

    def __init__(self, admin: AdminClient | str | os.PathLike[str], *, agents: int, flap_per_s: float = 0.0,
                 processes: int | None = None, register_s: float = REGISTER_INTERVAL_S, approve: bool = True,
                 tokens: str = "single", prefix: str = "sim", host: str = "127.0.0.1", concurrency: int = 4,
                 seed: int = 0, on_progress: Callable[[str], None] | None = None) -> None:
        if agents < 1:
            raise ValueError(f"agents must be at least 1, got {agents}")
        if tokens not in ("single", "reusable"):
            raise ValueError(f"tokens must be 'single' (one single-use token per agent) or 'reusable', got {tokens!r}")
        self._admin_arg = admin
        self.n, self.flap_per_s, self.register_s = agents, flap_per_s, register_s
        self.processes = processes or max(1, math.ceil(agents / AGENTS_PER_PROCESS))
        self.approve, self.tokens, self.prefix, self.host = approve, tokens, prefix, host
        self.concurrency, self.seed = concurrency, seed
        self.on_progress = on_progress or (lambda text: None)
        self.stats = SimStats()
        self.admin: AdminClient | None = None
        self._own_admin = False
        self._workers: list[_Worker] = []
        self._thread: LoopThread | None = None
        self.service: dict = {}

    # ---- async API -------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [f"{self.prefix}-{i:04d}" for i in range(self.n)]

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    async def async_start(self, timeout: float = 600.0) -> SimFleet:
        """Issue the tokens, start the workers, wait until every agent joined and registered once,
        then (``approve``) approve them all. SimFleetError (and everything stopped) otherwise."""
        self.admin, self._own_admin = _admin_client(self._admin_arg)
        try:
            async with asyncio.timeout(timeout):
                await self._async_start()
        except BaseException as exc:
            await self.async_stop()
            if isinstance(exc, TimeoutError):
                raise SimFleetError(f"the simulated fleet of {self.n} did not start within {timeout:g} s: "
                                    f"{len(self.stats.joined)} joined, errors: {self.stats.errors[:3]}") from None
            raise
        return self

    async def _async_start(self) -> None:
        self.service = await self.admin.async_service()
        hub = self.service.get("hub")
        if not hub:
            raise SimFleetError("the service's GET /service names no hub address; is it older than the harness?")
        start = time.perf_counter()
        tokens = await self._async_tokens()
        self.stats.token_s = time.perf_counter() - start
        self.on_progress(f"{len(set(tokens))} join token(s) issued in {self.stats.token_s:.1f} s")
        names = self.names
        start = time.perf_counter()
        for w in range(self.processes):
            mine = [(i, names[i], tokens[i]) for i in range(w, self.n, self.processes)]
            plan = {"enrollment": self.service["enrollment"], "hub": hub, "agents": mine, "register_s": self.register_s,
                    "flap_per_s": self.flap_per_s * len(mine) / self.n, "host": self.host,
                    "concurrency": self.concurrency, "seed": self.seed * 1000 + w}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.support.sim_fleet.worker", cwd=REPO, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, limit=1 << 22)
            worker = _Worker(w, proc)
            worker.send(**plan)
            worker.reader = asyncio.create_task(self._async_read(worker), name=f"sim-fleet-reader-{w}")
            self._workers.append(worker)
        await asyncio.gather(*(w.ready for w in self._workers))
        self.stats.join_wall_s = time.perf_counter() - start
        if self.stats.join_failed:
            name, error = next(iter(self.stats.join_failed.items()))
            raise SimFleetError(f"{len(self.stats.join_failed)} of {self.n} simulated agents could not join; "
                                f"{name}: {error}")
        self.on_progress(f"{self.n} agents joined (median {_median(self.stats.join_s) * 1000:.0f} ms each)")
        if self.approve and self.tokens == "single":
            await self.async_approve_all()
        elif self.approve:  # the reusable token auto-approves: wait for the service to have done it
            start = time.perf_counter()
            await self._async_until_listed(lambda a: a["approved"], "approved (auto-approval)")
            self.stats.approve_s = time.perf_counter() - start

    async def _async_tokens(self) -> list[str]:
        if self.tokens == "reusable":  # one token for every agent (helper A's reusable tokens)
            body = {"uses": self.n, "ttl_s": 3600.0, "auto_approve": self.approve, "label": f"{self.prefix} fleet"}
            try:
                token = str((await self.admin.async_call("POST", "/tokens", body))["token"])
            except AdminApiError as exc:
                raise SimFleetError(f"the service refused a reusable token ({exc}); use tokens='single'") from exc
            return [token] * self.n
        return [await self.admin.async_new_token(ttl_s=3600.0) for _ in range(self.n)]

    async def async_approve_all(self, timeout: float = 300.0) -> None:
        """Approve every simulated agent once the service lists it verified (its registration)."""
        wanted = set(self.stats.joined.values())
        agents = await self._async_until_listed(lambda a: a["verified"], "verified", timeout)
        todo = [a["node_id"] for a in agents if a["node_id"] in wanted and not a["approved"]]
        start = time.perf_counter()
        for node_id in todo:
            await self.admin.async_approve(node_id)
        self.stats.approve_s = time.perf_counter() - start
        self.on_progress(f"{len(todo)} agents approved in {self.stats.approve_s:.1f} s")

    async def _async_until_listed(self, predicate: Callable[[dict], bool], what: str,
                                  timeout: float = 300.0) -> list[dict]:
        """The service's agent list once ``predicate`` holds for every simulated agent in it."""
        wanted = set(self.stats.joined.values())
        deadline = time.monotonic() + timeout
        while True:
            agents = (await self.admin.async_agents())["agents"]
            done = {a["node_id"] for a in agents if a["node_id"] in wanted and predicate(a)}
            if done == wanted:
                return agents
            if time.monotonic() > deadline:
                raise SimFleetError(f"{len(wanted - done)} simulated agents are not listed {what} after {timeout:g} s")
            await asyncio.sleep(0.5 if self.n <= 100 else 2.0)  # listing 1,000 agents is itself work for the service

    async def _async_read(self, worker: _Worker) -> None:
        stats = self.stats
        try:
            while line := await worker.proc.stdout.readline():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                kind = event.get("ev")
                if kind == "joined":
                    stats.joined[event["name"]] = event["node_id"]
                    stats.join_s.append(event["join_s"])
                elif kind == "join_failed":
                    stats.join_failed[event["name"]] = event["error"]
                    stats.errors.append(f"{event['name']}: {event['error']}")
                elif kind == "stats":
                    stats.registered += event["registered"]
                    stats.register_failed += event["register_failed"]
                    stats.polls[worker.index] = event["polls"]
                    stats.flaps[worker.index] = event["flaps"]
                    stats.paused[worker.index] = event["paused"]
                    stats.errors += event["errors"]
                elif kind == "remote":
                    stats.remote.append((event["name"], event["paused"]))
                elif kind == "ready" and not worker.ready.done():
                    worker.ready.set_result(event["joined"])
        finally:
            code = await worker.proc.wait()
            worker.stopped.set()
            if not worker.ready.done():
                worker.ready.set_exception(SimFleetError(f"simulated-fleet worker {worker.index} exited {code} "
                                                         "before its agents joined"))

    def set_flap_rate(self, per_s: float) -> None:
        """Change the fleet-wide pause/resume rate (events per second, all agents together)."""
        self.flap_per_s = per_s
        sizes = [len(range(w, self.n, self.processes)) for w in range(self.processes)]
        for worker in self._workers:
            worker.send(cmd="flap", per_s=per_s * sizes[worker.index] / self.n)

    async def async_stop(self, timeout: float = 20.0) -> None:
        """Stop every worker (their agents close their control APIs); kill one that lingers."""
        for worker in self._workers:
            worker.send(cmd="stop")
            with contextlib.suppress(Exception):
                worker.proc.stdin.close()
        for worker in self._workers:
            try:
                await asyncio.wait_for(worker.stopped.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                await worker.proc.wait()
            if worker.reader is not None:
                with contextlib.suppress(Exception):
                    await worker.reader
        self._workers.clear()
        if self.admin is not None and self._own_admin:
            await self.admin.async_close()
        self.admin = None

    async def __aenter__(self) -> SimFleet:
        return await self.async_start()

    async def __aexit__(self, *exc: object) -> None:
        await self.async_stop()

    # ---- blocking API (its own loop thread; ``admin`` must then be a path) -------------------

    def start(self, timeout: float = 600.0) -> SimFleet:
        if isinstance(self._admin_arg, AdminClient):
            raise TypeError("the blocking API runs its own loop: pass the service's state dir or admin socket")
        self._thread = LoopThread("sim-fleet").start()
        self._thread.run(self.async_start(timeout), timeout + 30, "starting the simulated fleet")
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.run(self.async_stop(), 60, "stopping the simulated fleet")
            self._thread.stop()
            self._thread = None

    def call(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the fleet's loop (blocking API only): e.g. ``sim.call(lambda: sim.set_flap_rate(2))``."""
        assert self._thread is not None, "start() first"
        self._thread.call_soon(fn)

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0
