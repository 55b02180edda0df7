"""Supervision of the stage worker: a subprocess, so a crash or OOM in OpenVINO never takes the
agent (or the tray) down.

The worker is ``deskfleet worker ... --tls-stdin --report-interval 1 --exit-with-parent``: the
fleet credentials go in on stdin (never on disk or the command line), it prints a ready line
once its shard is verified, compiled and listening, then a stats line every second, from which
the agent reports steps/s. A worker that exits without being asked is restarted at once the
first time; a second crash within ``failure_window_s`` backs off (exponentially); after
``max_failures`` crashes within the window the supervisor gives up and reports ``failed`` with
the worker's last words.

**Warm spare.** With ``want_spare`` (the agent decides: its ``warm_spare`` setting and the PC's
free memory), ``spare_delay_s`` after the worker is ready a second worker process is started
with ``--spare``: the same shard opened, converted and compiled, not listening
(engine.worker.spare). When the worker dies, the spare is promoted at once — one activation line
on its stdin makes it bind the address the dead one left and dial the same next hop — and a new
spare is started behind it. A start whose launch differs from the spare's only in the addresses
and the peer policy (a failover re-pointed this stage, or moved a stage to this standby) is a
promotion too. A standby agent holds a spare with no worker (:meth:`async_start_spare`).

The credentials JSON carries the worker's peer policy too (``expect_upstream``, ``expect_next``,
``deny``: engine.trust.peer_policy). stdin stays open while the worker runs, so a new policy — a
failover moved a neighbour, the fleet service revoked a member — is one more JSON line on it
(:meth:`WorkerSupervisor.async_update_policy`) instead of a restart that would recompile the shard.

Stopping sends SIGTERM: the worker finishes the frame in hand, refuses new streams and exits,
releasing its cores; a worker that does not exit in time is killed. The spare stops with it
unless told to stay (``keep_spare``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import psutil

from agent.service.worker_process import WorkerLaunch, WorkerProcess
from engine.control.messages import WorkerStatus
from engine.tasks import start_task
from engine.worker.status_lines import PEERS_PREFIX, READY_PREFIX, STATS_PREFIX

log = logging.getLogger(__name__)

__all__ = ["Backoff", "WorkerLaunch", "WorkerSupervisor", "worker_args"]

SPARE_DELAY_S = 3.0  # after a worker is ready: its spare's compile must not slow the ring's replay
SPARE_IDLE_S = 2.0  # ... and the worker has computed nothing for this long (a compile takes every core)
SPARE_MAX_WAIT_S = 120.0  # a worker busy for longer gets its spare anyway


@dataclass(frozen=True)
class Backoff:
    """Restart delays: none for the first crash within ``failure_window_s``, then ``first_s``
    growing by ``factor`` up to ``max_s``; ``max_failures`` crashes in the window is final."""

    first_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    max_failures: int = 5
    failure_window_s: float = 300.0

    def delay(self, failures: int) -> float:
        """The wait before restarting after the ``failures``-th crash within the window."""
        if failures <= 1:
            return 0.0
        return min(self.max_s, self.first_s * self.factor ** (failures - 2))


class WorkerSupervisor:
    """Runs one worker at a time (and maybe its spare); ``on_change`` is called with every new
    :class:`WorkerStatus`."""

    def __init__(self, *, backoff: Backoff = Backoff(), stop_timeout_s: float = 10.0,
                 on_change: Callable[[WorkerStatus], None] = lambda s: None,
                 spare_delay_s: float = SPARE_DELAY_S) -> None:
        self.backoff = backoff
        self.stop_timeout_s = stop_timeout_s
        self.spare_delay_s = spare_delay_s
        self.want_spare = False  # keep a warm spare beside the worker (the agent sets it before each start)
        self._on_change = on_change
        self._status = WorkerStatus()
        self.hop_bytes_sent = 0  # every worker's frames to the next hop since the agent started (Prometheus)
        self._hop_bytes_seen: dict[int, int] = {}  # the current worker (id) -> its last reported count
        self._launch: WorkerLaunch | None = None
        self._task: asyncio.Task | None = None
        self._proc: WorkerProcess | None = None
        self._spare: WorkerProcess | None = None
        self._spare_task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._draining = False
        self._stop_timeout = stop_timeout_s
        self._last_exit: float | None = None  # wall time the last worker was seen gone unasked
        self._last_busy = 0.0  # monotonic time the worker's step count last grew
        # how each worker came up (wall-clock times; the failover benchmark's breakdown)
        self.starts: collections.deque[dict[str, Any]] = collections.deque(maxlen=16)

    @property
    def status(self) -> WorkerStatus:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(psutil.Error):
                return replace(self._status, rss_bytes=psutil.Process(pid).memory_info().rss)
        return self._status

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def spare_pid(self) -> int | None:
        """The warm spare's process id (None: no spare)."""
        return self._spare.pid if self._spare is not None else None

    @property
    def spare_ready(self) -> bool:
        """A spare is compiled and waiting."""
        return self._spare is not None and self._spare.alive and self._spare.spare_ready.is_set()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _set(self, **changes) -> None:
        self._status = replace(self._status, **changes)
        self._on_change(self._status)

    async def async_start(self, launch: WorkerLaunch) -> None:
        """Start (or restart with new arguments) the worker; returns once it is spawned (or a
        spare of the same shard promoted)."""
        await self.async_stop(keep_spare=True)
        self._launch = launch
        self._ready.clear()
        self._set(state="starting", restarts=0, last_error=None, steps_per_s=0.0, streams=0, policy_updates=0)
        self._task = start_task(self._async_supervise(), name="deskfleet-worker-supervisor", logger=log)

    async def async_start_spare(self, launch: WorkerLaunch) -> None:
        """Hold a warm spare of ``launch`` with no worker (a standby agent); a spare of another
        shard is replaced, one of the same is kept."""
        if self._spare is not None and self._spare.alive and self._spare.launch.spare_key() == launch.spare_key():
            return
        await self.async_stop_spare()
        await self._async_spawn_spare(launch)

    async def async_stop_spare(self) -> None:
        task, self._spare_task = self._spare_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        spare, self._spare = self._spare, None
        if spare is not None:
            await spare.async_terminate(self._stop_timeout)
            log.info("warm spare %s stopped", spare.proc.pid if spare.proc else "-")

    async def async_update_policy(self, policy: dict) -> bool:
        """Give the running worker a new peer policy (one JSON line on its stdin) and keep it for
        restarts; False if no worker runs or its stdin is closed (the caller restarts it)."""
        if self._launch is None:
            return False
        self._launch = self._launch.with_policy(policy)
        proc = self._proc
        if not self._launch.keep_stdin or proc is None or self._task is None:
            return False
        if not await proc.async_send(json.dumps(policy).encode() + b"\n"):
            log.warning("could not send the worker its new peer policy; restarting it")
            return False
        log.info("sent the worker a new peer policy")
        return True

    async def async_wait_ready(self, timeout: float) -> None:
        """Wait until the worker has printed its ready line, or raise TimeoutError naming why not."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            raise TimeoutError(f"the stage worker was not ready within {timeout:.0f} s "
                               f"(state {self._status.state}: {self._status.last_error or 'no error yet'})") from None

    async def async_stop(self, timeout: float | None = None, *, keep_spare: bool = False) -> None:
        """SIGTERM (drain the frame in hand), then SIGKILL after ``timeout`` (default
        ``stop_timeout_s``); no restart. The spare stops too unless ``keep_spare``."""
        self._stop_timeout = self.stop_timeout_s if timeout is None else timeout
        task, self._task = self._task, None
        self._ready.clear()

        async def stop_worker() -> None:
            if task is not None:
                task.cancel()  # the worker gets its SIGTERM now, not after the spare has stopped
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        # The worker is what holds the person's cores: it stops at once, the idle spare beside it.
        await asyncio.gather(stop_worker(), *(() if keep_spare else (self.async_stop_spare(),)))
        if task is None:
            return
        self._set(state="stopped", pid=None, steps_per_s=0.0, streams=0)

    async def async_drain(self, timeout: float) -> None:
        """SIGUSR1: the worker refuses new streams, lets those in flight finish, and exits; it is
        stopped outright if that takes longer than ``timeout``."""
        proc = self._proc
        if proc is None or not proc.alive or self._task is None:
            await self.async_stop()
            return
        self._draining = True
        proc.send_signal(signal.SIGUSR1)
        task = self._task
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            log.warning("the worker did not drain within %.0f s: stopping it", timeout)
        finally:
            self._draining = False
        await self.async_stop()

    async def _async_supervise(self) -> None:
        failures: list[float] = []
        while True:
            assert self._launch is not None
            code = await self._async_run_once(self._launch)  # the latest policy on a restart
            if self._draining:
                self._draining = False
                self._set(state="stopped", pid=None, steps_per_s=0.0, streams=0)
                return
            self._last_exit = time.time()
            now = time.monotonic()
            failures = [t for t in failures if now - t < self.backoff.failure_window_s] + [now]
            tail = " | ".join(list(self._proc.tail)[-3:]) if self._proc is not None else ""
            error = f"worker exited with code {code}: {tail}" if tail else f"worker exited with code {code}"
            log.warning("stage worker stopped unexpectedly (%s)", error)
            if len(failures) >= self.backoff.max_failures:
                self._set(state="failed", pid=None, last_error=error)
                return
            delay = self.backoff.delay(len(failures))
            self._set(state="backoff" if delay else "starting", pid=None, last_error=error,
                      restarts=self._status.restarts + 1)
            if delay:
                await asyncio.sleep(delay)
                self._set(state="starting")

    async def _async_bring_up(self, launch: WorkerLaunch) -> WorkerProcess:
        """The worker for ``launch``: its spare promoted when it has one, else a new process."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.alive and spare.launch.spare_key() == launch.spare_key():
            spare.launch = launch  # the addresses and peer policy it is activated with
            self._proc = spare
            if await spare.async_promote():
                log.info("promoted warm spare %s to serve", spare.pid)
                return spare
            await spare.async_terminate(1.0)
        elif spare is not None:
            await spare.async_terminate(self._stop_timeout)  # another shard or settings: of no use now
        proc = WorkerProcess(launch, self._on_line)
        self._proc = proc
        await proc.async_spawn()
        return proc

    async def _async_run_once(self, launch: WorkerLaunch) -> int:
        proc = await self._async_bring_up(launch)
        self._set(pid=proc.pid)
        try:
            return await proc.async_wait()
        except asyncio.CancelledError:
            await proc.async_terminate(self._stop_timeout)
            raise

    async def _async_spawn_spare(self, launch: WorkerLaunch, delay: float = 0.0) -> None:
        """Start a spare of ``launch`` after ``delay``; one beside a worker waits until that
        worker has been idle for SPARE_IDLE_S (at most SPARE_MAX_WAIT_S): the compile takes the
        PC's cores, and a spare must never slow the answers it is there to protect."""
        if delay:
            await asyncio.sleep(delay)
            waited = 0.0
            while self.running and time.monotonic() - self._last_busy < SPARE_IDLE_S and waited < SPARE_MAX_WAIT_S:
                await asyncio.sleep(0.5)
                waited += 0.5
            current = self._launch
            if (self._spare is not None and self._spare.alive) or current is None or \
                    current.spare_key() != launch.spare_key():
                return  # a spare came meanwhile, or the worker now serves something else
        spare = WorkerProcess(launch.as_spare(), self._on_spare_line)
        self._spare = spare
        await spare.async_spawn()
        log.info("warm spare %s starting (stage shard compiled beside the worker)", spare.pid)

    def _schedule_spare(self) -> None:
        if not self.want_spare or self._launch is None or (self._spare is not None and self._spare.alive):
            return
        if self._spare_task is not None and not self._spare_task.done():
            return
        self._spare_task = start_task(self._async_spawn_spare(self._launch, self.spare_delay_s),
                                      name="deskfleet-warm-spare", logger=log)

    def _on_spare_line(self, proc: WorkerProcess, text: str) -> None:
        if proc is self._proc:  # promoted: it speaks as the worker now
            self._on_line(proc, text)
            return
        proc.tail.append(text[:300])
        log.debug("spare: %s", text)

    def _count_hop_bytes(self, proc: WorkerProcess, sent: object) -> None:
        """Add what the worker sent to its next hop since its last stats line to :attr:`hop_bytes_sent`
        (a new worker process counts from zero; an old worker never reported it)."""
        if not isinstance(sent, int) or isinstance(sent, bool) or sent < 0:
            return
        before = self._hop_bytes_seen.get(id(proc), 0)
        self.hop_bytes_sent += max(0, sent - before)
        self._hop_bytes_seen = {id(proc): sent}

    def _on_line(self, proc: WorkerProcess, text: str) -> None:
        if proc is not self._proc:
            return
        if text.startswith(STATS_PREFIX):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                stats = json.loads(text[len(STATS_PREFIX):])
                now, steps = time.monotonic(), int(stats["steps"])
                rate = self._status.steps_per_s
                last = proc.last_stats
                if last is not None and now > last[0]:
                    rate = (steps - last[1]) / (now - last[0])
                if last is None or steps != last[1]:
                    self._last_busy = now
                proc.last_stats = (now, steps)
                self._status = replace(self._status, steps_per_s=round(rate, 2), streams=int(stats["streams"]))
                self._count_hop_bytes(proc, stats.get("bytes_out"))
            return
        if text.startswith(PEERS_PREFIX):
            log.info("worker: %s", text)
            self._set(policy_updates=self._status.policy_updates + 1)
            return
        proc.tail.append(text[:300])
        log.debug("worker: %s", text)
        if text.startswith(READY_PREFIX):
            self.starts.append({"pid": proc.pid, "promoted": proc.promoted, "spawned": proc.spawned_at,
                                "previous_exit": self._last_exit, "ready": time.time(), **proc.timing})
            self._ready.set()
            self._set(state="running", last_error=None)
            self._schedule_spare()


def worker_args(shard_dir: str, stage: int, listen: str, next_hop: str, *, device: str, threads: int | None,
                exact: bool, tls: bool, cache_dir: str | None = None, paged: bool = False,
                kv_pool_mb: int | None = None) -> tuple[str, ...]:
    """The ``deskfleet worker`` arguments of one stage; ``paged`` serves it on PagedAttention with a
    KV block pool of at most ``kv_pool_mb`` MiB (the agent's budget; None: the worker's default)."""
    if kv_pool_mb is not None and not paged:
        raise ValueError("kv_pool_mb sizes a paged stage's block pool; pass paged=True")
    args: list[str] = ["--shard", shard_dir, "--stage", str(stage), "--listen", listen, "--next", next_hop,
                       "--device", device]
    if paged:
        args.append("--paged")
        if kv_pool_mb is not None:
            args += ["--kv-pool-mb", str(kv_pool_mb)]
    if cache_dir:
        args += ["--cache-dir", cache_dir]
    if threads:
        args += ["--threads", str(threads)]
    if exact:
        args.append("--exact")
    if tls:
        args.append("--tls-stdin")
    return tuple(args)

