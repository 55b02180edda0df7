"""A standby's warm spare: the stage the fleet service expects this agent to take over in a failover.

``POST /v1/spare`` names the stage (as the assignment the agent would get); the agent fetches the
stage's files if it lacks them and keeps a spare worker compiled (engine.worker.spare) through
its :class:`~agent.service.supervisor.WorkerSupervisor`. The assignment that later moves the
stage here promotes the spare instead of starting a worker. Kept in memory only: a restarted
agent holds no spare until the fleet service asks again. A paused PC starts it when the pause ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from agent.service.supervisor import WorkerLaunch, WorkerSupervisor
from engine.control.messages import Assignment
from engine.errors import DeskfleetError
from engine.tasks import start_task

log = logging.getLogger(__name__)


class StandbySpare:
    """``launch(assignment)``: the worker launch of that stage; ``fetch(assignment)``: its files
    fetched and verified (raises DeskfleetError or OSError)."""

    def __init__(self, supervisor: WorkerSupervisor, *, launch: Callable[[Assignment], WorkerLaunch],
                 fetch: Callable[[Assignment], Awaitable[None]]) -> None:
        self._supervisor = supervisor
        self._launch = launch
        self._fetch = fetch
        self.wanted: Assignment | None = None
        self._task: asyncio.Task | None = None

    def same_stage(self, assignment: Assignment) -> bool:
        wanted = self.wanted
        return wanted is not None and (wanted.export_id, wanted.stage) == (assignment.export_id, assignment.stage)

    async def async_hold(self, assignment: Assignment, *, paused: bool) -> None:
        """Keep a spare of ``assignment``'s stage (from the pause's end when ``paused``)."""
        self.wanted = assignment
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if paused:
            log.info("holding a warm spare of %s stage %d once the pause ends", assignment.export_id, assignment.stage)
            return
        self._task = start_task(self._async_prepare(assignment), name="deskfleet-standby-spare", logger=log)

    async def async_resume(self) -> None:
        """The pause ended: start the spare that was asked for."""
        if self.wanted is not None:
            await self.async_hold(self.wanted, paused=False)

    def taken(self, assignment: Assignment) -> None:
        """This agent now serves ``assignment``: if it is the spared stage, the spare serves it."""
        if self.same_stage(assignment):
            self.wanted = None

    async def async_drop(self) -> None:
        """Hold no standby spare (a serving worker's own spare stays)."""
        self.wanted = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if not self._supervisor.running:
            await self._supervisor.async_stop_spare()

    async def _async_prepare(self, assignment: Assignment) -> None:
        try:
            await self._fetch(assignment)
            await asyncio.sleep(self._supervisor.spare_delay_s)  # not while the ring replays on a shared PC
            await self._supervisor.async_start_spare(self._launch(assignment))
        except asyncio.CancelledError:
            raise
        except (DeskfleetError, OSError) as exc:
            log.warning("could not prepare the warm spare for %s stage %d: %s", assignment.export_id,
                        assignment.stage, exc)
