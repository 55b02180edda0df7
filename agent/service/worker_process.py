"""One ``deskfleet worker`` subprocess and what it said on stdout.

:class:`~agent.service.supervisor.WorkerSupervisor` runs one serving worker and, when the PC's
memory allows, a warm spare beside it (engine.worker.spare). Both are a :class:`WorkerProcess`:
the spare is promoted by one activation line on its stdin and then simply is the serving one,
its stdout read by the same task from spawn to exit.
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

from engine.tasks import start_task
from engine.trust.peer_policy import POLICY_KEYS
from engine.wire.address import Address
from engine.worker.spare import SPARE_PREFIX, TIMING_PREFIX, Activation

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

    # -- as a spare ------------------------------------------------------------------------------

    def as_spare(self) -> WorkerLaunch:
        """The launch of a spare for this worker: the same shard and settings, activated later."""
        return replace(self, args=(*self.args, "--spare"), keep_stdin=True)

    def spare_key(self) -> tuple:
        """What a spare must share with this launch to take its place: every argument but the
        addresses (the activation gives those) and the credentials (not the peer policy)."""
        args, skip = [], False
        for arg in self.args:
            if skip:
                skip = False
            elif arg in ("--listen", "--next"):
                skip = True
            elif arg != "--spare":
                args.append(arg)
        blob = json.loads(self.stdin or b"{}")
        return tuple(args), tuple(sorted((k, v) for k, v in blob.items() if k not in POLICY_KEYS))

    def activation(self) -> bytes:
        """The line that puts a spare of this launch where this launch would serve."""
        listen = Address.parse(self.args[self.args.index("--listen") + 1])
        next_hop = Address.parse(self.args[self.args.index("--next") + 1])
        blob = json.loads(self.stdin or b"{}")
        return Activation(listen, next_hop).to_line({k: v for k, v in blob.items() if k in POLICY_KEYS})


class WorkerProcess:
    """A worker subprocess; ``on_line(process, text)`` gets every stdout line but the spare and
    timing lines it keeps itself. ``spawned_at``/``timing`` are wall-clock times."""

    def __init__(self, launch: WorkerLaunch, on_line: Callable[[WorkerProcess, str], None]) -> None:
        self.launch = launch
        self._on_line = on_line
        self.proc: asyncio.subprocess.Process | None = None
        self.spawned_at = 0.0
        self.timing: dict[str, float] = {}
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.spare_ready = asyncio.Event()
        self.promoted = False
        self.last_stats: tuple[float, int] | None = None  # (monotonic time, steps) of the last stats line
        self._reader: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def async_spawn(self) -> None:
        self.spawned_at = time.time()
        proc = await asyncio.create_subprocess_exec(
            *self.launch.command(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        self.proc = proc
        assert proc.stdin is not None
        proc.stdin.write(self.launch.stdin)
        await proc.stdin.drain()
        if not self.launch.keep_stdin:
            proc.stdin.close()
        self._reader = start_task(self._async_read(), name="deskfleet-worker-stdout", logger=log)

    async def async_send(self, line: bytes, timeout: float = 5.0) -> bool:
        """Write one line on the worker's stdin; False if it is closed or gone."""
        proc = self.proc
        if proc is None or proc.returncode is not None or proc.stdin is None or proc.stdin.is_closing():
            return False
        try:
            proc.stdin.write(line)
            await asyncio.wait_for(proc.stdin.drain(), timeout)
        except (OSError, TimeoutError) as exc:
            log.warning("could not write to the worker's stdin: %s", exc)
            return False
        return True

    async def async_promote(self) -> bool:
        """Activate this spare where ``launch`` serves (its addresses and peer policy)."""
        self.promoted = True
        return await self.async_send(self.launch.activation())

    async def async_wait(self) -> int:
        """Until the process exits (its stdout read to the end); its exit code."""
        assert self.proc is not None and self._reader is not None
        await asyncio.wait({self._reader})  # a cancelled caller is cancelled; the reader runs on
        return await self.proc.wait()

    async def async_terminate(self, timeout: float) -> None:
        """SIGTERM (the frame in hand finishes), SIGKILL after ``timeout``."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            log.warning("stage worker %d did not stop within %.1f s of SIGTERM: killing it", proc.pid, timeout)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def _async_read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            if text.startswith(SPARE_PREFIX):
                self.spare_ready.set()
                log.info("warm spare %d ready: %s", self.proc.pid, text[len(SPARE_PREFIX):])
                continue
            if text.startswith(TIMING_PREFIX):
                with contextlib.suppress(ValueError, TypeError):
                    self.timing = {k: float(v) for k, v in json.loads(text[len(TIMING_PREFIX):]).items()}
                continue
            self._on_line(self, text)
