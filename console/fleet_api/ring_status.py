"""A ring's bring-up as the fleet service reports it: each agent's phase and progress, and the
ring's health after its one-token test (the distribution itself: :mod:`console.fleet.distribution`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RingPhase(StrEnum):
    """Where a ring of the fleet service is (``phase`` in the admin API's ring JSON, this value)."""

    PENDING = "pending"  # created or re-run, its bring-up not begun
    EXPORTING = "exporting"  # its model is being exported with the plan's split
    DISTRIBUTING = "distributing"  # shards to the agents, workers starting, the ring's test token
    SERVING = "serving"
    STOPPING = "stopping"
    FAILED = "failed"  # ``error`` says why; a failed ring is re-run (by the admin, or by the service)


class AgentPhase(StrEnum):
    """Where one agent of a ring's bring-up is (``phase`` of an agent's progress, this value)."""

    ASSIGNING = "assigning"
    FETCHING = "fetching"
    VERIFIED = "verified"  # its stage's shards are on disk, checked
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"


@dataclass(frozen=True)
class AgentProgress:
    """Where one agent is; bytes are its stage's shard files. ``phase`` may be given as its value
    (the admin API's JSON, the distribution's reports): it is held as an AgentPhase."""

    agent: str
    stage: int
    phase: AgentPhase
    done_bytes: int = 0
    total_bytes: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", AgentPhase(self.phase))

    @property
    def fraction(self) -> float:
        return 1.0 if self.total_bytes == 0 else self.done_bytes / self.total_bytes


@dataclass(frozen=True)
class RingHealth:
    """The ring as last checked: every agent's phase, and the one-token test generation."""

    agents: tuple[AgentProgress, ...]
    local_stage0: bool
    test_token: int | None
    test_ms: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        running = all(a.phase is AgentPhase.RUNNING for a in self.agents)
        return self.error is None and self.test_token is not None and running
