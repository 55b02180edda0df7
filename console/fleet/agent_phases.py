"""One agent's way through a distribution, reported as it goes.

:class:`ProgressBoard` keeps every agent's last :class:`~console.fleet_api.ring_status.AgentProgress`
and tells the listener each change; :func:`async_fetch_shard` and :func:`async_start_stage_worker`
drive one agent through fetching its stage's files and starting its stage worker, polling its
status until it gets there, fails, or runs out of time. A failure is data
(:class:`~console.fleet.errors.AgentFailure`), not an exception: the
:class:`~console.fleet.distribution.Distributor` gives every agent its chance before it names them all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from console.fleet.errors import AgentFailure
from console.fleet.ring_layout import AgentTarget
from console.fleet_api.ring_status import AgentPhase, AgentProgress
from engine.control.client import ControlClient
from engine.control.messages import AgentStatus
from engine.shards.manifest import Manifest


@dataclass(frozen=True)
class DistributionTimeouts:
    """Seconds each phase may take; ``poll_s`` is how often agents are asked for their status."""

    fetch_s: float = 1800.0
    start_s: float = 300.0
    dial_s: float = 60.0
    health_s: float = 60.0
    poll_s: float = 0.2


class ProgressBoard:
    """Every agent's last progress; ``on_progress(progress)`` hears each one that changed."""

    def __init__(self, manifest: Manifest, on_progress: Callable[[AgentProgress], None]) -> None:
        self._manifest = manifest
        self._on_progress = on_progress
        self._progress: dict[AgentTarget, AgentProgress] = {}

    def progress(self, targets: tuple[AgentTarget, ...]) -> tuple[AgentProgress, ...]:
        """The last progress of each of ``targets`` that reported one, in their order."""
        return tuple(self._progress[t] for t in targets if t in self._progress)

    def report(self, target: AgentTarget, phase: AgentPhase, status: AgentStatus | None = None,
               error: str | None = None) -> AgentProgress:
        total = sum(e.size for e in self._manifest.stages[target.stage].files)
        done = 0
        if status is not None and status.fetch.total_bytes:
            done, total = status.fetch.done_bytes, status.fetch.total_bytes
        if phase in (AgentPhase.VERIFIED, AgentPhase.STARTING, AgentPhase.RUNNING):
            done = total
        progress = AgentProgress(target.label, target.stage, phase, done, total, error)
        if self._progress.get(target) != progress:
            self._progress[target] = progress
            self._on_progress(progress)
        return progress

    def fail(self, target: AgentTarget, message: str, status: AgentStatus | None = None) -> AgentFailure:
        """Report ``target`` failed and return the failure to name it by."""
        self.report(target, AgentPhase.FAILED, status, error=message)
        return AgentFailure(target.label, target.stage, message)


async def async_fetch_shard(client: ControlClient, target: AgentTarget, export_id: str, board: ProgressBoard,
                            timeouts: DistributionTimeouts) -> AgentFailure | None:
    """Have the assigned agent fetch and verify its stage's files (nothing to do when its worker
    already serves the same assignment); raises ControlError when the agent does not answer."""
    status = await client.async_status()
    if status.worker.state == "running":  # the same assignment as before: still serving
        board.report(target, AgentPhase.RUNNING, status)
        return None
    await client.async_fetch()
    deadline = time.monotonic() + timeouts.fetch_s
    while True:
        status = await client.async_status()
        if status.export_id != export_id or status.stage != target.stage:
            return board.fail(target, f"it was given another assignment ({status.export_id} stage "
                              f"{status.stage}) while fetching; is another console managing it?", status)
        if status.fetch.error:
            return board.fail(target, f"fetching its shard failed: {status.fetch.error}", status)
        if status.fetch.finished:
            board.report(target, AgentPhase.VERIFIED, status)
            return None
        board.report(target, AgentPhase.FETCHING, status)
        if time.monotonic() > deadline:
            return board.fail(target, f"the fetch did not finish within {timeouts.fetch_s:.0f} s "
                              f"({status.fetch.done_bytes} of {status.fetch.total_bytes} bytes); check "
                              "its network to the console and run the distribution again", status)
        await asyncio.sleep(timeouts.poll_s)


async def async_start_stage_worker(client: ControlClient, target: AgentTarget, board: ProgressBoard,
                                   timeouts: DistributionTimeouts) -> AgentFailure | None:
    """Start the agent's stage worker (unless it runs) and wait until it runs; raises ControlError
    when the agent does not answer."""
    status = await client.async_status()
    if status.worker.state != "running":
        board.report(target, AgentPhase.STARTING, status)
        await client.async_start_worker()
    deadline = time.monotonic() + timeouts.start_s
    while True:
        status = await client.async_status()
        worker = status.worker
        if worker.state == "running":
            board.report(target, AgentPhase.RUNNING, status)
            return None
        if status.state == "paused":  # before the worker check: a paused agent's worker is stopped
            return board.fail(target, f"it is paused ({', '.join(status.paused_reasons)}); its worker "
                              "starts when the pause ends. Run the distribution again then, or re-plan "
                              "without this PC", status)
        if worker.state in ("failed", "stopped"):
            return board.fail(target, f"its stage worker {worker.state}: "
                              f"{worker.last_error or 'no reason given'}; see the agent's log", status)
        if time.monotonic() > deadline:
            return board.fail(target, f"its stage worker was not running within {timeouts.start_s:.0f} s "
                              f"(state {worker.state}: {worker.last_error or 'no error yet'})", status)
        board.report(target, AgentPhase.STARTING, status)
        await asyncio.sleep(timeouts.poll_s)
