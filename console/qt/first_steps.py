"""The Dashboard's checklist from an empty fleet to a served model, decided from the service's
state (no Qt): join PCs, approve them, serve the default model, try it in Chat. Each step ticks
itself off when the service says it is done, so a second console, or an admin who did a step on
the expert pages, sees the same list.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.model_entry import ModelEntry
from console.fleet_api.ring_status import RingPhase
from console.qt.fleet_overview import awaiting_approval, members


class StepKey(StrEnum):
    JOIN = "join"
    APPROVE = "approve"
    SERVE = "serve"
    CHAT = "chat"


PAGES = {StepKey.JOIN: "Fleet", StepKey.APPROVE: "Fleet", StepKey.SERVE: "Distribution", StepKey.CHAT: "Chat"}


@dataclass(frozen=True)
class Step:
    """One line of the checklist: ``page`` is the console tab that does it by hand."""

    key: StepKey
    title: str
    done: bool
    detail: str
    can_act: bool = False  # its one-press button may be pressed now

    @property
    def page(self) -> str:
        """The console tab that does this step by hand."""
        return PAGES[self.key]


@dataclass(frozen=True)
class FleetNow:
    """What the checklist reads: the agent records, the rings (id -> the feed's JSON) and their
    metrics (id -> sample), the join token and the console address agents join at."""

    records: Sequence[AgentRecord]
    rings: Mapping[str, Mapping[str, Any]]
    metrics: Mapping[str, Mapping[str, float]]
    token: str
    enrollment: str
    model: str  # the model "Serve" brings up ("" when the library has none)
    serve_busy: bool = False


def default_model(models: Iterable[ModelEntry]) -> ModelEntry | None:
    """The model chosen for an admin who has not chosen one: the embedded default when it is
    installed, else the first available one."""
    available = [m for m in models if m.available]
    return next((m for m in available if m.kind == "default"), available[0] if available else None)


def join_commands(token: str, enrollment: str) -> str:
    """How a PC joins, per kind of PC: the tray on a desktop, one command on a server."""
    return (f"Windows, macOS or a Linux desktop: install Deskfleet, open its tray icon → Join a fleet…, paste the "
            f"token (it finds this console by itself; else its address is {enrollment or '…'}).\n"
            f"A Linux server without a desktop:\n    echo {token or 'TOKEN'} | deskfleet agent --headless --join -")


def serving_rings(rings: Mapping[str, Mapping[str, Any]]) -> list[str]:
    return [ring for ring, data in rings.items() if data.get("phase") == RingPhase.SERVING]


def checklist(now: FleetNow) -> tuple[Step, ...]:
    """The four steps, each done or not by what the service reports now."""
    joined = members(now.records)
    waiting = awaiting_approval(now.records)
    approved = [r for r in joined if r.approved]
    serving = serving_rings(now.rings)
    answered = sum(float(now.metrics.get(ring, {}).get("requests_finished_total", 0.0)) for ring in serving)
    n = len(joined)
    join = Step(StepKey.JOIN, "Join PCs to the fleet", n > 0,
                f"{n} PC{'s' if n != 1 else ''} joined. More can join the same way:\n"
                + join_commands(now.token, now.enrollment) if n else join_commands(now.token, now.enrollment))
    if waiting:
        approve_detail = (f"{len(waiting)} PC{'s wait' if len(waiting) != 1 else ' waits'} for approval: "
                          + ", ".join(r.name for r in waiting[:6]) + ("…" if len(waiting) > 6 else ""))
    elif approved:
        approve_detail = f"{len(approved)} PC{'s' if len(approved) != 1 else ''} approved."
    else:
        approve_detail = "A PC that joined waits here until you approve it."
    approve = Step(StepKey.APPROVE, "Approve them", bool(approved) and not waiting, approve_detail,
                   can_act=bool(waiting))
    if serving:
        models = sorted({str(now.rings[r].get("model", "")) for r in serving})
        serve_detail = f"Serving {', '.join(models)}."
    elif not now.model:
        serve_detail = "The library has no model to serve: add one on the Models page."
    else:
        serve_detail = (f"One press places {now.model} on the approved PCs and distributes it with the defaults. "
                        "Models, Placement and Distribution are there to tune it.")
    serve = Step(StepKey.SERVE, "Serve the default model", bool(serving), serve_detail,
                 can_act=bool(approved) and not serving and bool(now.model) and not now.serve_busy)
    chat = Step(StepKey.CHAT, "Try it in Chat", answered > 0,
                "The fleet has answered a chat." if answered > 0 else
                ("Ask it something on the Chat page; employees chat from their tray." if serving else
                 "Once a model is served, ask it something here or from a PC's tray."),
                can_act=bool(serving))
    return join, approve, serve, chat
