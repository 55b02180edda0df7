"""Supervision of a local fleet's worker processes (``serve --workers``, ``demo --serve``): the
recovery the console gives its agents' rings, for workers that are this process's children.

A worker that exits is noticed at once (its process is awaited: no step timeout needed) and the
coordinator is told to fail over, naming the stage, so that ``/health`` says *recovering* while
its streams are held. The coordinator's recover hook is :meth:`LocalSupervisor.async_recover`:
it starts every dead worker again on its address and next hop (at once after a first crash,
after a back-off when it keeps crashing: :class:`~engine.tools.restart_policy.RestartPolicy`),
re-dials the ring under a new session, and the coordinator replays every held stream. With
``spares`` each stage also has a warm spare (``worker --spare``: imported, its shard compiled, not
listening), so "start again" is "tell the spare to listen where the dead worker did": no
spawn, imports or compile on the clock; a new spare is started a little later. A stage
the policy gives up raises :class:`StageDownError` naming it, so its held requests fail at once
(HTTP 503) with the reason instead of waiting out the hold time, and the ring reports *down*.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import psutil

from engine.errors import DeskfleetError
from engine.tasks import start_task
from engine.tools.restart_policy import RestartPolicy
from engine.tools.worker_processes import LocalFleet, WorkerStartError

log = logging.getLogger(__name__)

# an exit seen and the coordinator's failover not yet asking: wait this long for it to reap
_REAP_GRACE_S = 0.5
# a used spare is replaced this long after the ring is back, so that its compile does not compete
# with the replay for this machine's cores
SPARE_REFILL_DELAY_S = 5.0


class StageDownError(DeskfleetError):
    """A local worker could not be brought back (it crash-loops, or cannot start: a missing or
    corrupt shard file, its port taken); ``stage`` says which (None: the ring keeps stopping with
    every worker alive, so which stage is stuck is not known)."""

    def __init__(self, stage: int | None, message: str):
        super().__init__(message)
        self.stage = stage


class FailsOver(Protocol):
    """A coordinator a supervisor can tell that a stage is gone."""

    def request_failover(self, reason: str, stage: int | None = None) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class Redialling(Protocol):
    async def async_reconnect(self) -> None: ...


P = TypeVar("P", bound=Redialling)


@dataclass(frozen=True)
class Restart:
    """One worker brought back, in ``time.monotonic()`` seconds: its exit seen, the process that
    came up spawned, it reported ready (imports, shard checks, conversion and compile), the ring
    re-dialled (with a spare, "spawned" is when it was told to take over). ``attempts``: starts it
    took (more than one after a failed start); ``start``: the worker's own account of its start
    (:meth:`LocalFleet.start_breakdown`, empty if it gave none)."""

    stage: int
    exit_code: int | None
    noticed_at: float
    spawned_at: float
    ready_at: float
    reconnected_at: float
    attempts: int = 1
    start: tuple[tuple[str, float], ...] = ()
    spare: bool = False  # a warm spare took the dead worker's place

    def breakdown(self) -> dict[str, float]:
        """Seconds spent waiting (back-off), starting (spawn to ready, and its parts if known) and re-dialling."""
        return {"backoff_s": self.spawned_at - self.noticed_at, "start_s": self.ready_at - self.spawned_at,
                **dict(self.start), "redial_s": self.reconnected_at - self.ready_at}


def describe_exit(code: int | None) -> str:
    """``-9`` -> "was killed by SIGKILL"; ``1`` -> "exited with code 1"."""
    if code is None:
        return "stopped answering"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class LocalSupervisor:
    """Watches every worker of ``fleet``; its :meth:`async_recover` is the coordinator's recover hook."""

    def __init__(self, fleet: LocalFleet, policy: RestartPolicy | None = None,
                 on_restart: Callable[[Restart], None] | None = None, spares: bool = False,
                 on_spare: Callable[[int], None] | None = None):
        self.fleet = fleet
        self.spares = spares
        self.on_spare = on_spare  # hears each stage whose warm spare is compiled and waiting
        self._refill: asyncio.Task | None = None
        self.policy = policy or RestartPolicy()
        self.on_restart = on_restart
        self.restarts: list[Restart] = []
        self._crashes: dict[int, list[float]] = collections.defaultdict(list)
        self._exits: dict[int, tuple[float, int | None]] = {}  # stage -> (seen at, exit code) of its last death
        self._last_error: dict[int, str] = {}
        self._noted: set[int] = set()  # pids whose exit is counted
        self._watches: dict[int, asyncio.Task] = {}
        self._target: FailsOver | None = None
        self._closing = False
        # (tokens generated, when) at the last recovery that found every worker alive
        self._alive_recovery: tuple[float, float] | None = None

    def attach(self, target: FailsOver) -> None:
        """Start watching every worker; a death is reported to ``target``."""
        self._target = target
        for stage, proc in self.fleet.processes.items():
            self._watch(stage, proc)
        if self.spares:
            self._refill_spares(0.0)

    def _refill_spares(self, delay: float) -> None:
        if self._closing or (self._refill is not None and not self._refill.done()):
            return
        self._refill = start_task(self._async_keep_spares(delay), name="deskfleet-spares", logger=log)

    async def _async_keep_spares(self, delay: float) -> None:
        """Start a warm spare for every stage that has none (one at a time: they share the cores)."""
        await asyncio.sleep(delay)
        for stage in sorted(self.fleet.processes):
            spare = self.fleet.spares.get(stage)
            if spare is not None and spare.returncode is None:
                continue
            try:
                await self.fleet.async_start_spare(stage)
            except WorkerStartError as exc:
                log.warning("local fleet: no warm spare for stage %d (%s); a lost worker is started anew", stage, exc)
                continue
            log.info("local fleet: a warm spare for stage %d is compiled and waiting", stage)
            if self.on_spare is not None:
                self.on_spare(stage)

    def close(self) -> None:
        """Stop watching (before the fleet is stopped, so that its workers' exits are not crashes)."""
        self._closing = True
        if self._refill is not None:
            self._refill.cancel()
        for task in self._watches.values():
            task.cancel()
        self._watches.clear()

    def dead_stages(self) -> list[int]:
        return sorted(s for s, p in self.fleet.processes.items() if p.returncode is not None)

    def _watch(self, stage: int, proc: asyncio.subprocess.Process) -> None:
        old = self._watches.pop(stage, None)
        if old is not None:
            old.cancel()
        self._watches[stage] = start_task(self._async_watch(stage, proc), name=f"deskfleet-watch{stage}", logger=log)

    async def _async_watch(self, stage: int, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._closing or self.fleet.processes.get(stage) is not proc:
            return
        self._note_exit(stage, proc)
        reason = f"stage {stage}'s worker (pid {proc.pid}) {describe_exit(code)}"
        log.warning("local fleet: %s", reason)
        if self._target is not None:
            self._target.request_failover(reason, stage)

    def _note_exit(self, stage: int, proc: asyncio.subprocess.Process) -> None:
        if proc.pid in self._noted:
            return
        self._noted.add(proc.pid)
        now = time.monotonic()
        self._crashes[stage].append(now)
        self._exits[stage] = (now, proc.returncode)
        self._last_error[stage] = f"its worker {describe_exit(proc.returncode)}"

    async def async_recover(self, path: P, reason: str) -> P:
        """Bring every dead worker back and re-dial ``path``; StageDownError for one given up."""
        if not self.dead_stages():  # a stage's error can come before its worker's exit is reaped
            waits = [asyncio.ensure_future(p.wait()) for p in self.fleet.processes.values()]
            _, pending = await asyncio.wait(waits, timeout=_REAP_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
        if not self.dead_stages():
            await self._async_end_the_stuck(reason)
        else:
            self._alive_recovery = None
        back = []
        for stage in self.dead_stages():
            self._note_exit(stage, self.fleet.processes[stage])
            back.append(await self._async_bring_back(stage))
        await path.async_reconnect()
        reconnected = time.monotonic()
        for stage, spawned, ready, attempts, spare in back:
            noticed, code = self._exits[stage]
            restart = Restart(stage, code, noticed, spawned, ready, reconnected, attempts,
                              tuple(self.fleet.start_breakdown(stage).items()), spare)
            self.restarts.append(restart)
            log.warning("local fleet: stage %d is back in %.2f s (%s)", stage, reconnected - noticed,
                        ", ".join(f"{k} {v:.2f}" for k, v in restart.breakdown().items()))
            if self.on_restart is not None:
                self.on_restart(restart)
        if back and self.spares:
            self._refill_spares(SPARE_REFILL_DELAY_S)
        return path

    async def _async_end_the_stuck(self, reason: str) -> None:
        """Every worker is alive yet the ring stopped answering: a stopped worker (SIGSTOP, a
        debugger) is killed so that it is restarted like a dead one; otherwise the ring is only
        re-dialled, and if it stops again with no token generated in between, it is given up
        (a stage is stuck; re-dialling again would hold every request forever)."""
        for stage, proc in sorted(self.fleet.processes.items()):
            with contextlib.suppress(psutil.Error):
                if psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
                    log.warning("local fleet: stage %d's worker (pid %d) is stopped; killing it to restart it",
                                stage, proc.pid)
                    proc.kill()
                    await proc.wait()
        if self.dead_stages():
            return
        tokens = self._target.metrics().get("tokens_generated_total", 0.0) if self._target is not None else 0.0
        now = time.monotonic()
        last = self._alive_recovery
        if last is not None and last[0] == tokens and now - last[1] <= self.policy.window_s:
            raise StageDownError(None, f"the ring stopped answering again ({reason}) with every worker alive and "
                                 "no token generated since the last time: a stage is stuck, not dead; restart "
                                 "`deskfleet serve` (its workers' error output may say which)")
        self._alive_recovery = (tokens, now)

    async def _async_bring_back(self, stage: int) -> tuple[int, float, float, int, bool]:
        """Start ``stage``'s worker again as the policy allows (its warm spare first, if it has one):
        (stage, spawned at, ready at, attempts, whether the spare took over)."""
        attempts = 0
        while True:
            if self._closing:  # the fleet is being stopped: start nothing it would not stop
                raise StageDownError(stage, f"the local fleet is stopping; stage {stage} is not restarted")
            crashes = self._crashes[stage]
            delay = self.policy.delay(crashes, time.monotonic())
            if delay is None:
                n = self.policy.recent(crashes, time.monotonic())
                raise StageDownError(stage, f"stage {stage} cannot be brought back: {n} crashes within "
                                     f"{self.policy.window_s:.0f} s, the last: {self._last_error[stage]}. It is "
                                     f"not restarted again until those are {self.policy.window_s:.0f} s old; "
                                     "see the worker's error output, fix the cause and retry")
            if delay:
                log.warning("local fleet: stage %d crashed %d times within %.0f s; restarting it in %.1f s",
                            stage, self.policy.recent(crashes, time.monotonic()), self.policy.window_s, delay)
                await asyncio.sleep(delay)
            attempts += 1
            spawned = time.monotonic()
            if self.spares and await self.fleet.async_activate_spare(stage):
                self._watch(stage, self.fleet.processes[stage])
                return stage, spawned, time.monotonic(), attempts, True
            try:
                await self.fleet.async_restart(stage)
            except WorkerStartError as exc:
                self._noted.add(self.fleet.processes[stage].pid)  # counted here, with its reason
                crashes.append(time.monotonic())
                self._last_error[stage] = str(exc)
                log.warning("local fleet: %s", exc)
                continue
            self._watch(stage, self.fleet.processes[stage])
            return stage, spawned, time.monotonic(), attempts, False
