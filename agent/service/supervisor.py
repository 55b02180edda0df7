"""Supervision of the stage worker: a subprocess, so a crash or OOM in OpenVINO never takes the
agent (or the tray) down.

The worker is ``deskfleet worker ... --tls-stdin --report-interval 1 --exit-with-parent``: the
fleet credentials go in on stdin (never on disk or the command line), it prints a ready line
once its shard is verified, compiled and listening, then a stats line every second, from which
the agent reports steps/s. A worker that exits without being asked is restarted with
exponential backoff; after ``max_failures`` crashes within ``failure_window_s`` the supervisor
gives up and reports ``failed`` with the worker's last words.

The credentials JSON carries the worker's peer policy too (``expect_upstream``, ``expect_next``,
``deny``: engine.trust.peer_policy). stdin stays open while the worker runs, so a new policy — a
failover moved a neighbour, the console revoked a member — is one more JSON line on it
(:meth:`WorkerSupervisor.async_update_policy`) instead of a restart that would recompile the shard.

Stopping sends SIGTERM: the worker finishes the frame in hand, refuses new streams and exits,
releasing its cores; a worker that does not exit in time is killed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil

from engine.control.messages import WorkerStatus
from engine.worker.status_lines import PEERS_PREFIX, READY_PREFIX, STATS_PREFIX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLaunch:
    """What to run: the ``deskfleet worker`` arguments and the credentials JSON for stdin (one
    line). ``keep_stdin``: leave stdin open for policy updates (a worker that reads them)."""

    args: tuple[str, ...]
    stdin: bytes = b""
    keep_stdin: bool = False

    def with_policy(self, policy: dict) -> WorkerLaunch:
        """The same launch with ``policy``'s keys replacing those in the stdin JSON."""
        blob = json.loads(self.stdin or b"{}")
        blob.update(policy)
        return replace(self, stdin=json.dumps(blob).encode() + b"\n")

    def command(self) -> list[str]:
        return [sys.executable, "-m", "engine.cli.main", "worker", *self.args, "--report-interval", "1",
                "--exit-with-parent"]


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    max_failures: int = 5
    failure_window_s: float = 300.0

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.first_s * self.factor ** max(0, failures - 1))


class WorkerSupervisor:
    """Runs one worker at a time; ``on_change`` is called with every new :class:`WorkerStatus`."""

    def __init__(self, *, backoff: Backoff = Backoff(), stop_timeout_s: float = 10.0,
                 on_change: Callable[[WorkerStatus], None] = lambda s: None) -> None:
        self.backoff = backoff
        self.stop_timeout_s = stop_timeout_s
        self._on_change = on_change
        self._status = WorkerStatus()
        self._launch: WorkerLaunch | None = None
        self._task: asyncio.Task | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._ready = asyncio.Event()
        self._tail: collections.deque[str] = collections.deque(maxlen=20)
        self._draining = False
        self._stop_timeout = stop_timeout_s

    @property
    def status(self) -> WorkerStatus:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(psutil.Error):
                return replace(self._status, rss_bytes=psutil.Process(self._proc.pid).memory_info().rss)
        return self._status

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _set(self, **changes) -> None:
        self._status = replace(self._status, **changes)
        self._on_change(self._status)

    async def async_start(self, launch: WorkerLaunch) -> None:
        """Start (or restart with new arguments) the worker; returns once it is spawned."""
        await self.async_stop()
        self._launch = launch
        self._ready.clear()
        self._set(state="starting", restarts=0, last_error=None, steps_per_s=0.0, streams=0, policy_updates=0)
        self._task = asyncio.create_task(self._async_supervise(launch), name="deskfleet-worker-supervisor")

    async def async_update_policy(self, policy: dict) -> bool:
        """Give the running worker a new peer policy (one JSON line on its stdin) and keep it for
        restarts; False if no worker runs or its stdin is closed (the caller restarts it)."""
        if self._launch is None:
            return False
        self._launch = self._launch.with_policy(policy)
        proc = self._proc
        if (not self._launch.keep_stdin or proc is None or proc.returncode is not None or proc.stdin is None
                or proc.stdin.is_closing() or self._task is None):
            return False
        try:
            proc.stdin.write(json.dumps(policy).encode() + b"\n")
            await asyncio.wait_for(proc.stdin.drain(), 5.0)
        except (OSError, TimeoutError) as exc:
            log.warning("could not send the worker its new peer policy (%s); restarting it", exc)
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

    async def async_stop(self, timeout: float | None = None) -> None:
        """SIGTERM (drain the frame in hand), then SIGKILL after ``timeout`` (default
        ``stop_timeout_s``); no restart."""
        self._stop_timeout = self.stop_timeout_s if timeout is None else timeout
        task, self._task = self._task, None
        self._ready.clear()
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._set(state="stopped", pid=None, steps_per_s=0.0, streams=0)

    async def async_drain(self, timeout: float) -> None:
        """SIGUSR1: the worker refuses new streams, lets those in flight finish, and exits; it is
        stopped outright if that takes longer than ``timeout``."""
        if self._proc is None or self._proc.returncode is not None or self._task is None:
            await self.async_stop()
            return
        self._draining = True
        self._proc.send_signal(signal.SIGUSR1)
        task = self._task
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            log.warning("the worker did not drain within %.0f s: stopping it", timeout)
        finally:
            self._draining = False
        await self.async_stop()

    async def _async_supervise(self, launch: WorkerLaunch) -> None:
        failures: list[float] = []
        while True:
            code = await self._async_run_once(self._launch or launch)  # the latest policy on a restart
            if self._draining:
                self._draining = False
                self._set(state="stopped", pid=None, steps_per_s=0.0, streams=0)
                return
            now = time.monotonic()
            failures = [t for t in failures if now - t < self.backoff.failure_window_s] + [now]
            tail = " | ".join(list(self._tail)[-3:])
            error = f"worker exited with code {code}: {tail}" if tail else f"worker exited with code {code}"
            log.warning("stage worker stopped unexpectedly (%s)", error)
            if len(failures) >= self.backoff.max_failures:
                self._set(state="failed", pid=None, last_error=error)
                return
            delay = self.backoff.delay(len(failures))
            self._set(state="backoff", pid=None, last_error=error, restarts=self._status.restarts + 1)
            await asyncio.sleep(delay)
            self._set(state="starting")

    async def _async_run_once(self, launch: WorkerLaunch) -> int:
        self._tail.clear()
        proc = await asyncio.create_subprocess_exec(
            *launch.command(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        self._proc = proc
        self._set(pid=proc.pid)
        try:
            proc.stdin.write(launch.stdin)
            await proc.stdin.drain()
            if not launch.keep_stdin:
                proc.stdin.close()
            await self._async_read(proc)
            return await proc.wait()
        except asyncio.CancelledError:
            await self._async_terminate(proc)
            raise

    async def _async_read(self, proc: asyncio.subprocess.Process) -> None:
        last: tuple[float, int] | None = None
        while line := await proc.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            if text.startswith(STATS_PREFIX):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    stats = json.loads(text[len(STATS_PREFIX):])
                    now, steps = time.monotonic(), int(stats["steps"])
                    rate = self._status.steps_per_s
                    if last is not None and now > last[0]:
                        rate = (steps - last[1]) / (now - last[0])
                    last = (now, steps)
                    self._status = replace(self._status, steps_per_s=round(rate, 2), streams=int(stats["streams"]))
                continue
            if text.startswith(PEERS_PREFIX):
                log.info("worker: %s", text)
                self._set(policy_updates=self._status.policy_updates + 1)
                continue
            self._tail.append(text[:300])
            log.debug("worker: %s", text)
            if text.startswith(READY_PREFIX):
                self._ready.set()
                self._set(state="running", last_error=None)

    async def _async_terminate(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        timeout = self._stop_timeout
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            log.warning("stage worker did not stop within %.1f s of SIGTERM: killing it", timeout)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


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

