"""The worker processes of a fleet on this machine: one ``deskfleet worker`` subprocess per stage of
one export on loopback (and, with spares, a compiled ``worker --spare`` beside each), started from
the last stage backwards, each on a free port it reports on stdout. Each worker's error output is
passed through to ours and its last lines kept, so that a worker that cannot start is named with
its own reason. :mod:`engine.tools.local_fleet` puts a coordinator in front of them and
:mod:`engine.tools.local_supervisor` restarts the ones that die.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from engine.errors import DeskfleetError
from engine.shards.manifest import load_manifest
from engine.tasks import start_task
from engine.wire.address import Address
from engine.worker.spare import SPARE_PREFIX, TIMING_PREFIX, Activation
from engine.worker.status_lines import READY_PREFIX

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
STDERR_TAIL_LINES = 20


Hop = Callable[[Address], Awaitable[Address]]


async def _direct(address: Address) -> Address:
    return address


class WorkerStartError(DeskfleetError):
    """A worker process exited or stayed silent before reporting its address."""


class LocalFleet:
    """Worker subprocesses for stages ``first_stage..N-1`` of one export.

    ``cache_dir``: every worker's OpenVINO CACHE_DIR, so a restarted worker's compile is a cache hit.
    """

    def __init__(self, export_dir: Path | str, *, first_stage: int = 0, host: str = "127.0.0.1",
                 exact: bool = False, threads: int | None = None, extra_args: Sequence[str] = (),
                 cache_dir: Path | str | None = None):
        self.export_dir = Path(export_dir)
        self.manifest = load_manifest(self.export_dir)
        self.first_stage = first_stage
        self.host = host
        self.exact = exact
        self.threads = threads
        self.extra_args = tuple(extra_args)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.addresses: dict[int, Address] = {}
        self.next_hops: dict[int, Address] = {}
        self.stderr_tails: dict[int, collections.deque[str]] = {}
        self.timings: dict[int, dict[str, float]] = {}  # stage -> its last start's wall-clock times
        self.spares: dict[int, asyncio.subprocess.Process] = {}  # stage -> a warm spare, compiled, not listening
        self._spare_times: dict[int, dict[str, float]] = {}
        self._spare_pipes: dict[int, tuple[collections.deque[str], asyncio.Task]] = {}
        self._pipes: set[asyncio.Task] = set()

    def _argv(self, stage: int, next_address: Address, listen: Address | None = None) -> list[str]:
        argv = [sys.executable, "-m", "engine.cli.main", "worker", "--shard", str(self.export_dir),
                "--stage", str(stage), "--listen", str(listen) if listen else f"{self.host}:0",
                "--next", str(next_address), "--exit-with-parent"]
        if self.exact:
            argv.append("--exact")
        if self.threads:
            argv += ["--threads", str(self.threads)]
        if self.cache_dir is not None:
            argv += ["--cache-dir", str(self.cache_dir)]
        return argv + list(self.extra_args)

    async def _exec(self, argv: list[str], tail: collections.deque[str], name: str,
                    stdin: int | None = None) -> tuple[asyncio.subprocess.Process, asyncio.Task]:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=stdin, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stderr is not None
        task = start_task(_pass_through(proc.stderr, tail), name=f"deskfleet-{name}-stderr", logger=log,
                          keep=self._pipes)
        return proc, task

    async def _spawn(self, stage: int, next_address: Address, listen: Address | None = None) -> Address:
        """Start stage ``stage``'s worker and wait for it to report its address."""
        self.timings[stage] = {"spawned": time.time()}
        tail = self.stderr_tails[stage] = collections.deque(maxlen=STDERR_TAIL_LINES)
        proc, task = await self._exec(self._argv(stage, next_address, listen), tail, f"worker{stage}")
        self.processes[stage] = proc
        self.next_hops[stage] = next_address
        try:
            return await self._await_ready(stage, proc, task)
        except BaseException:  # not ready (or cancelled while starting): never leave it half-started
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise

    async def async_start_spare(self, stage: int) -> None:
        """Start a warm spare for ``stage`` (``worker --spare``: Python started, OpenVINO imported,
        the shard checked, converted and compiled, not listening) and wait until it is compiled;
        WorkerStartError if it does not get there."""
        times = {"spawned": time.time()}
        tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        argv = self._argv(stage, self.next_hops[stage]) + ["--spare"]
        proc, task = await self._exec(argv, tail, f"spare{stage}", stdin=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        try:
            while True:
                line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
                if not line:
                    code = await proc.wait()
                    why = next((t.strip() for t in reversed(tail) if t.strip()), "")
                    raise WorkerStartError(f"the spare for stage {stage} exited with code {code} before it was "
                                           f"compiled" + (f": {why}" if why else ""))
                if line.decode(errors="replace").startswith(SPARE_PREFIX):
                    break
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            if isinstance(exc, TimeoutError):
                raise WorkerStartError(f"the spare for stage {stage} was not compiled within "
                                       f"{READY_TIMEOUT_S:.0f} s") from None
            raise
        times["compiled"] = time.time()
        self.spares[stage] = proc
        self._spare_times[stage] = times
        self._spare_pipes[stage] = (tail, task)

    async def async_activate_spare(self, stage: int) -> bool:
        """Put ``stage``'s warm spare in the place of its dead worker (its address and next hop):
        True once it listens there, False if there was no live spare or it failed to take over."""
        proc = self.spares.pop(stage, None)
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return False
        self.timings[stage] = {**self._spare_times.pop(stage, {}), "activation_sent": time.time()}
        tail, task = self._spare_pipes.pop(stage)
        self.stderr_tails[stage] = tail
        try:
            proc.stdin.write(Activation(self.addresses[stage], self.next_hops[stage]).to_line())
            await proc.stdin.drain()
            self.processes[stage] = proc
            await self._await_ready(stage, proc, task)
        except (OSError, WorkerStartError) as exc:
            log.warning("the spare for stage %d could not take over (%s); starting a new worker instead", stage, exc)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return False
        return True

    def last_error_line(self, stage: int) -> str:
        """The last line stage ``stage``'s worker wrote to its error output ("" if none)."""
        lines = [line for line in self.stderr_tails.get(stage, ()) if line.strip()]
        return lines[-1].strip() if lines else ""

    def start_breakdown(self, stage: int) -> dict[str, float]:
        """Where stage ``stage``'s last start went, in seconds, as far as its worker said: spawn and
        imports, opening (checks, conversion) and compiling the shard, then opening its listener."""
        t = self.timings.get(stage, {})
        if "activation_sent" in t:  # a spare: its imports and compile happened before, off the clock
            spans: tuple[tuple[str, str, str], ...] = (("activate_s", "activation_sent", "listening"),)
        else:
            spans = (("spawn_imports_s", "spawned", "entered"), ("open_compile_s", "entered", "opened"),
                     ("listen_s", "opened", "listening"))
        return {name: t[b] - t[a] for name, a, b in spans if a in t and b in t}

    async def async_start(self, return_address: Address, hop: Hop | None = None) -> Address:
        """Start every worker (last stage first); returns the address to dial the first one on.

        ``hop(address)`` may put something in front of every hop (a WAN emulator) and return the
        address to use instead; it is applied to the return hop and to each worker.
        """
        hop = hop or _direct
        next_address = await hop(return_address)
        for stage in reversed(range(self.first_stage, len(self.manifest.stages))):
            self.addresses[stage] = await self._spawn(stage, next_address)
            next_address = await hop(self.addresses[stage])
        return next_address

    async def _await_ready(self, stage: int, proc: asyncio.subprocess.Process, stderr: asyncio.Task) -> Address:
        assert proc.stdout is not None
        try:
            while True:
                line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
                if not line:
                    code = await proc.wait()
                    with contextlib.suppress(TimeoutError):  # its last words, for the error
                        await asyncio.wait_for(asyncio.shield(stderr), 2.0)
                    why = self.last_error_line(stage)
                    raise WorkerStartError(f"the worker for stage {stage} exited with code {code} before it was "
                                           f"ready" + (f": {why}" if why else "; see its error output above"))
                text = line.decode(errors="replace")
                if text.startswith(TIMING_PREFIX):
                    with contextlib.suppress(ValueError, TypeError):
                        self.timings[stage].update({k: float(v) for k, v in json.loads(text[len(TIMING_PREFIX):])
                                                    .items()})
                if text.startswith(READY_PREFIX) and " on " in text:
                    return Address.parse(text.split(" on ", 1)[1].split(",", 1)[0].strip())
        except TimeoutError:
            raise WorkerStartError(f"the worker for stage {stage} did not report ready within "
                                   f"{READY_TIMEOUT_S:.0f} s") from None

    async def async_restart(self, stage: int) -> None:
        """Start stage ``stage``'s worker again on its address and next hop (its process must have
        exited); WorkerStartError, with the worker's own reason, if it does not come up."""
        proc = self.processes[stage]
        if proc.returncode is None:
            raise WorkerStartError(f"the worker for stage {stage} (pid {proc.pid}) is still running")
        await self._spawn(stage, self.next_hops[stage], listen=self.addresses[stage])

    async def async_restart_dead(self) -> list[int]:
        """Start again, on the same address and next hop, every worker whose process has exited;
        returns the restarted stages."""
        restarted = []
        for stage, proc in sorted(self.processes.items()):
            if proc.returncode is not None:
                await self.async_restart(stage)
                restarted.append(stage)
        return restarted

    async def async_stop(self) -> dict[int, int]:
        """SIGTERM every worker (they drain and exit 0) and spare; kill any that outstays the timeout."""
        codes: dict[int, int] = {}
        spares, self.spares = list(self.spares.values()), {}
        for proc in [*self.processes.values(), *spares]:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for stage, proc in self.processes.items():
            try:
                codes[stage] = await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("worker for stage %d did not stop in %.0f s; killing it", stage, STOP_TIMEOUT_S)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                codes[stage] = await proc.wait()
        for proc in spares:
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for task in list(self._pipes):
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 2.0)
        return codes


async def _pass_through(stream: asyncio.StreamReader, tail: collections.deque[str]) -> None:
    """Copy a worker's error output to ours line by line, keeping its last lines in ``tail``."""
    while line := await stream.readline():
        text = line.decode(errors="replace")
        tail.append(text)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(text)
            sys.stderr.flush()
