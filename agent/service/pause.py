"""When the agent steps aside: a pure decision over what the PC reports.

The person at the PC always comes first. Four independent reasons pause the agent — the manual
pause from the tray or the fleet service, someone using the PC, running on battery, office hours —
and it serves again only when none holds. "In use" has hysteresis: a keystroke pauses at once
(the benchmark target is cores released within 2 s of input), but serving resumes only after
the PC has been idle for ``resume_after_idle_s``, so a person reading a page is not interrupted
by a fleet that keeps coming back.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from agent.service.settings import AgentSettings, OfficeHours

MANUAL = "paused by the user"
REMOTE = "paused from the console"  # a reason agents report in their status (older ones too): kept as is
IN_USE = "the PC is in use"
BATTERY = "on battery"
OFFICE_HOURS = "office hours"
INPUT_WINDOW_S = 1.0  # input this recent means someone is at the PC (polled every 0.25 s)
_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


@dataclass(frozen=True)
class Observation:
    """One reading of the PC: seconds since the last input (None: unknown), power, the time."""

    idle_s: float | None
    on_ac: bool | None
    now: dt.datetime


@dataclass(frozen=True)
class PauseState:
    """The decision and the memory the next decision needs (whether we were paused for use)."""

    reasons: tuple[str, ...] = ()
    in_use: bool = False

    @property
    def paused(self) -> bool:
        return bool(self.reasons)


def in_office_hours(hours: OfficeHours | None, now: dt.datetime) -> bool:
    if hours is None:
        return False
    return _DAYS[now.weekday()] in hours.days and hours.start <= now.strftime("%H:%M") < hours.end


def decide(settings: AgentSettings, obs: Observation, previous: PauseState, *, manual: bool = False,
           remote: bool = False) -> PauseState:
    """The pause state after ``obs``; ``previous`` supplies the in-use hysteresis."""
    in_use = False
    if settings.pause_while_in_use and obs.idle_s is not None:
        recent_input = obs.idle_s < INPUT_WINDOW_S
        still_busy = previous.in_use and obs.idle_s < settings.resume_after_idle_s
        in_use = recent_input or still_busy
    reasons = []
    if manual:
        reasons.append(MANUAL)
    if remote:
        reasons.append(REMOTE)
    if in_use:
        reasons.append(IN_USE)
    if settings.pause_on_battery and obs.on_ac is False:
        reasons.append(BATTERY)
    if in_office_hours(settings.office_hours, obs.now):
        reasons.append(OFFICE_HOURS)
    return PauseState(tuple(reasons), in_use)
