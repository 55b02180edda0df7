"""A worker process of the simulated fleet: many :class:`SimAgent` on one asyncio loop.

Started by :class:`tests.support.sim_fleet.SimFleet` as ``python -m tests.support.sim_fleet.worker``.
It reads one JSON line on stdin (its :class:`WorkerPlan`), then commands, one JSON object a line:
``{"cmd": "flap", "per_s": X}`` (this worker's pause/resume rate) or ``{"cmd": "stop"}``; end of
input stops it too. It writes JSON lines on stdout (``ev`` names each):

``joined`` {name, node_id, port, join_s}, ``join_failed`` {name, error}, ``ready`` {joined},
``stats`` {registered: [round trips s], register_failed, polls, flaps, paused: [names], errors: [text]} about
once a second, ``remote`` {name, paused} (the service paused / resumed it), ``stopped``.

Each agent registers at the hub once right after its join (as the real agent does after
``async_join``) and then every ``register_s`` from a random phase, so registrations spread over
the interval as a real office's do. Joins and registrations go out a few at a time
(``concurrency``): every simulated agent shares 127.0.0.1, and the service's listeners cap the
connections of one address (engine.http_limits), which an office of separate PCs never meets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass

from tests.support.sim_fleet.agent import SimAgent


@dataclass(frozen=True)
class WorkerPlan:
    enrollment: str
    hub: str
    agents: tuple[tuple[int, str, str], ...]  # (index, name, join token)
    register_s: float
    flap_per_s: float
    host: str = "127.0.0.1"
    concurrency: int = 4
    seed: int = 0

    @classmethod
    def from_json(cls, data: dict) -> WorkerPlan:
        return cls(data["enrollment"], data["hub"], tuple(tuple(a) for a in data["agents"]), float(data["register_s"]),
                   float(data["flap_per_s"]), data.get("host", "127.0.0.1"), int(data.get("concurrency", 4)),
                   int(data.get("seed", 0)))


def _say(**event) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


class Worker:
    def __init__(self, plan: WorkerPlan) -> None:
        self.plan = plan
        self.random = random.Random(plan.seed)
        self.agents: list[SimAgent] = []
        self.slots = asyncio.Semaphore(plan.concurrency)
        self.flap_per_s = plan.flap_per_s
        self.registered: list[float] = []
        self.register_failed = 0
        self.flaps = 0
        self.errors: list[str] = []
        self.stop = asyncio.Event()
        self.flap_changed = asyncio.Event()

    async def _async_join(self, index: int, name: str, token: str) -> None:
        agent = SimAgent(name, index, host=self.plan.host)
        agent.on_remote = lambda a, paused: _say(ev="remote", name=a.name, paused=paused)
        try:
            async with self.slots:
                start = time.perf_counter()
                await agent.async_join(self.plan.enrollment, token, timeout=60)
                join_s = time.perf_counter() - start
                await agent.async_open()
        except Exception as exc:
            _say(ev="join_failed", name=name, error=f"{type(exc).__name__}: {exc}")
            return
        self.agents.append(agent)
        _say(ev="joined", name=name, node_id=agent.creds.node_id, port=agent.control_port, join_s=round(join_s, 4))
        await self._async_register(agent)

    async def _async_register(self, agent: SimAgent) -> None:
        async with self.slots:
            try:
                took = await agent.async_register(self.plan.hub)
            except Exception as exc:
                took = None
                self._error(f"{agent.name}: registration failed: {exc}")
        if took is None:
            self.register_failed += 1
        else:
            self.registered.append(took)

    def _error(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text[:300])

    async def _async_register_loop(self, agent: SimAgent) -> None:
        await asyncio.sleep(self.random.uniform(0, self.plan.register_s))
        while True:
            await self._async_register(agent)
            await asyncio.sleep(self.plan.register_s)

    async def _async_flap_loop(self) -> None:
        """Pauses and resumes at random (a Poisson process of ``flap_per_s``): each flips one
        agent picked at random, as a person sitting down at or leaving a PC."""
        while True:
            if self.flap_per_s <= 0 or not self.agents:
                self.flap_changed.clear()
                await self.flap_changed.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flap_changed.wait(), self.random.expovariate(self.flap_per_s))
                self.flap_changed.clear()
                continue  # the rate changed: draw the next wait at the new one
            agent = self.random.choice(self.agents)
            try:
                async with self.slots:
                    await agent.async_set_local_pause(not agent.local_paused, self.plan.hub)
                self.flaps += 1
            except Exception as exc:
                self._error(str(exc))

    async def _async_report_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._report()

    def _report(self) -> None:
        _say(ev="stats", registered=[round(t, 5) for t in self.registered], register_failed=self.register_failed,
             polls=sum(a.polls for a in self.agents), flaps=self.flaps, errors=self.errors,
             paused=sorted(a.name for a in self.agents if a.reasons))
        self.registered, self.register_failed, self.errors = [], 0, []

    async def _async_commands(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            with contextlib.suppress(ValueError):
                cmd = json.loads(line)
                if cmd.get("cmd") == "stop":
                    break
                if cmd.get("cmd") == "flap":
                    self.flap_per_s = max(0.0, float(cmd.get("per_s", 0.0)))
                    self.flap_changed.set()
        self.stop.set()

    async def async_run(self) -> None:
        commands = asyncio.create_task(self._async_commands())
        await asyncio.gather(*(self._async_join(i, n, t) for i, n, t in self.plan.agents))
        _say(ev="ready", joined=len(self.agents))
        tasks = [asyncio.create_task(self._async_register_loop(a)) for a in self.agents]
        tasks += [asyncio.create_task(self._async_flap_loop()), asyncio.create_task(self._async_report_loop())]
        await self.stop.wait()
        for task in (*tasks, commands):
            task.cancel()
        self._report()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(a.async_close() for a in self.agents), return_exceptions=True), 10)
        _say(ev="stopped")


def main() -> int:
    plan = WorkerPlan.from_json(json.loads(sys.stdin.readline()))
    asyncio.run(Worker(plan).async_run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
