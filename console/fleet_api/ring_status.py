"""A ring's bring-up as the fleet service reports it: each agent's phase and progress, and the
ring's health after its one-token test (the distribution itself: :mod:`console.fleet.distribution`).
"""

from __future__ import annotations

from dataclasses import dataclass

PHASES = ("assigning", "fetching", "verified", "starting", "running", "failed")


@dataclass(frozen=True)
class AgentProgress:
    """Where one agent is: ``phase`` is one of PHASES; bytes are its stage's shard files."""

    agent: str
    stage: int
    phase: str
    done_bytes: int = 0
    total_bytes: int = 0
    error: str | None = None

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
        return self.error is None and self.test_token is not None and all(a.phase == "running" for a in self.agents)
