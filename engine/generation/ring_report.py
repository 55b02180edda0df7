"""What one serving ring says about itself: the fact ``/health``, the router and the fleet
service's watch all read, so that a dead stage is never reported as "ok".

A ring is *ok* when every stage is connected and answering; *recovering* while a lost stage is
being restarted or moved and its streams are held (requests wait, up to the hold time);
*down* when it cannot serve (it failed its held requests, or it was never brought up), with
``detail`` naming the stage and why. ``active`` and ``waiting`` are what the router balances on.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class RingStatus(enum.StrEnum):
    OK = "ok"
    RECOVERING = "recovering"
    DOWN = "down"


@dataclass(frozen=True)
class RingReport:
    ring: str  # the ring's id within its service ("default" for a lone ring)
    model: str  # the served model's name (what /v1/models lists)
    status: RingStatus
    detail: str = ""  # for RECOVERING/DOWN: which stage, and why ("stage 1 (pc-3): worker exited 137")
    stage: int | None = None  # the stage the detail is about, when one is
    active: int = 0  # streams generating now
    waiting: int = 0  # requests admitted but not yet generating

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"ring": self.ring, "model": self.model, "status": self.status.value,
                                  "active": self.active, "waiting": self.waiting}
        if self.detail:
            out["detail"] = self.detail
        if self.stage is not None:
            out["stage"] = self.stage
        return out


def overall_status(reports: Sequence[RingReport]) -> RingStatus:
    """The service's one word: ok when every ring is, down when none can serve, else recovering."""
    if reports and all(r.status is RingStatus.OK for r in reports):
        return RingStatus.OK
    if not reports or all(r.status is RingStatus.DOWN for r in reports):
        return RingStatus.DOWN
    return RingStatus.RECOVERING


def coordinator_report(ring: str, model: str, *, running: bool, recovering: bool, down: bool,
                       trouble: tuple[str, int | None] | None, path: object, active: int,
                       waiting: int) -> RingReport:
    """What a coordinator of one ring reports: down when it is not ``running``, recovering while
    its streams are held, down when its last failover failed (``trouble`` names the stage and
    why) or its first hop's connection is closed (``path.connected``; stage 1 when the
    coordinator hosts stage 0 itself, ``path.hosts_stage0``), else ok."""
    def report(status: RingStatus, detail: str = "", stage: int | None = None) -> RingReport:
        return RingReport(ring, model, status, detail, stage, active, waiting)

    if not running:
        return report(RingStatus.DOWN, "the coordinator is not running")
    if recovering or down:
        detail, stage = trouble or ("a stage stopped answering", None)
        return report(RingStatus.RECOVERING if recovering else RingStatus.DOWN, detail, stage)
    if not getattr(path, "connected", True):
        first = 1 if getattr(path, "hosts_stage0", False) else 0
        return report(RingStatus.DOWN, f"the connection to stage {first} is closed", first)
    return report(RingStatus.OK)


@runtime_checkable
class Reporting(Protocol):
    """A generator that is (or fronts) serving rings and can say how they are."""

    def ring_reports(self) -> tuple[RingReport, ...]: ...
