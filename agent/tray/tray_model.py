"""What the tray shows, decided without Qt: the status line, the menu's state, and which status
changes deserve a desktop notification.

Pure functions of :class:`engine.control.messages.AgentStatus` and the settings, so every rule is tested
without a QApplication; :mod:`agent.tray.tray` only copies the result onto its QActions.
"""

from __future__ import annotations

import datetime as dt
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from agent.service import pause
from agent.service.settings import AgentSettings
from engine.control.messages import AgentStatus

STARTING = "starting"  # not an agent state: the tray's own, until the service's first status
STATUS_MAX_CHARS = 90
NO_CHAT_ADDRESS = ("Chat is not available on this PC yet: it opens once the fleet's admin has approved this PC "
                   "and the fleet serves a model. Ask your fleet's admin if it stays this way.")
NOT_JOINED_CHAT = "Chat is for PCs in a fleet: join one first (Join a fleet…)."
MORNING = dt.time(8, 0)  # "until tomorrow" resumes at this local time the next day


class PauseFor(StrEnum):
    """The timed pauses the menu offers, as Syncthing and Tailscale do."""

    HOUR = "Pause for 1 hour"
    TOMORROW = "Pause until tomorrow"


def pause_until(choice: PauseFor, now: dt.datetime) -> dt.datetime:
    """When a timed pause chosen at ``now`` (local time) ends."""
    if choice is PauseFor.HOUR:
        return now + dt.timedelta(hours=1)
    return dt.datetime.combine(now.date() + dt.timedelta(days=1), MORNING, tzinfo=now.tzinfo)


def clock(moment: dt.datetime, now: dt.datetime) -> str:
    """"14:36", or "tomorrow 08:00" when ``moment`` is on another day than ``now``."""
    hhmm = moment.strftime("%H:%M")
    return hhmm if moment.date() == now.date() else f"tomorrow {hhmm}" if moment.date() == now.date() + \
        dt.timedelta(days=1) else moment.strftime("%a %H:%M")


@dataclass(frozen=True)
class Notice:
    """One desktop notification; ``level`` is "info", "warning" or "error"."""

    title: str
    message: str
    level: str = "info"


@dataclass(frozen=True)
class MenuState:
    status: str
    pause_text: str  # "Pause" or "Resume"
    pause_enabled: bool
    manually_paused: bool
    pause_while_in_use: bool
    joined: bool  # "Join a fleet…" hidden, "Leave fleet" shown
    start_at_login: bool


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= STATUS_MAX_CHARS else text[: STATUS_MAX_CHARS - 1] + "…"


@dataclass(frozen=True)
class TrayContext:
    """What the status line needs beyond the agent's status: the time now (local), how many parts
    the model this PC helps with has (None: unknown), and the end of a timed pause of the person's."""

    now: dt.datetime
    parts: int | None = None
    paused_until: dt.datetime | None = None
    resume_after_idle_s: float = 300.0


def _part(status: AgentStatus, parts: int | None) -> str:
    """"(part 1 of 2)": people's words for a stage (numbered from 1)."""
    if status.export_id is None or status.stage is None:
        return ""
    return f"(part {status.stage + 1} of {parts})" if parts else f"(part {status.stage + 1})"


def _paused(status: AgentStatus, c: TrayContext) -> str:
    reasons = set(status.paused_reasons)
    if pause.MANUAL in reasons:
        return (f"Paused by you until {clock(c.paused_until, c.now)}" if c.paused_until is not None
                else "Paused by you — Resume lends this PC to the fleet again")
    if pause.REMOTE in reasons:
        return "Paused by the fleet's admin — ask them to resume it"
    if reasons == {pause.IN_USE}:
        resume = c.now + dt.timedelta(seconds=c.resume_after_idle_s)
        return f"Paused while you use this PC — resumes at {clock(resume, c.now)} if idle"
    return f"Paused: {', '.join(status.paused_reasons)}"


def status_line(status: AgentStatus | None, context: TrayContext | None = None) -> str:
    """One line for the top of the menu in people's words, e.g. "Helping the fleet (part 1 of 2)"."""
    if status is None:
        return "Starting…"
    c = context or TrayContext(dt.datetime.now())
    part = _part(status, c.parts)
    if status.state == "not-joined":
        return "Not in a fleet: join one to lend this PC"
    if status.state == "paused":
        return _short(_paused(status, c))
    if status.state == "error":
        return _short(f"Something went wrong: {status.worker.last_error or 'the fleet work stopped'}")
    if status.state == "fetching":
        return _short(f"Getting its share of the model {part} · {status.fetch.fraction:.0%}")
    if status.state == "serving":
        return _short(f"Helping the fleet {part}" + ("" if status.worker.state == "running" else " · starting"))
    if part:
        return _short(f"Ready to help the fleet {part}")
    if status.api_url:
        return "Approved — no work for this PC right now"
    return "Joined — awaiting approval by the fleet's admin"


def menu_state(status: AgentStatus | None, settings: AgentSettings, start_at_login: bool,
               context: TrayContext | None = None) -> MenuState:
    joined = status is not None and status.state != "not-joined"
    manual = status is not None and pause.MANUAL in status.paused_reasons
    context = context or TrayContext(dt.datetime.now(), resume_after_idle_s=settings.resume_after_idle_s)
    return MenuState(status=status_line(status, context), pause_text="Resume" if manual else "Pause",
                     pause_enabled=joined, manually_paused=manual,
                     pause_while_in_use=settings.pause_while_in_use, joined=joined,
                     start_at_login=start_at_login)


def notices_between(before: AgentStatus | None, after: AgentStatus) -> list[Notice]:
    """The notifications for one status change (none for the first status after start-up).

    A pause is announced with its reasons, except when the only reason is that the person is
    using the PC and nothing was being served: they caused it, and telling them every time they
    touch the keyboard would turn the tray into noise.
    """
    if before is None:
        return []
    notices = []
    if not before.fleet_id and after.fleet_id:
        notices.append(Notice("Joined the fleet",
                              f"This PC ({after.name}) is now part of fleet {after.fleet_id[:16]}. It serves "
                              "only while nobody is using it."))
    elif before.fleet_id and not after.fleet_id:
        notices.append(Notice("Left the fleet", "This PC no longer serves the fleet; its fleet certificate "
                              "was deleted."))
    if after.state == "paused" and before.state != "paused":
        reasons = after.paused_reasons
        if reasons == (pause.IN_USE,) and before.state == "serving":
            notices.append(Notice("Deskfleet paused", "Paused while you use this PC: the fleet carries on without "
                                  "it, and it helps again once the PC is idle."))
        elif reasons != (pause.IN_USE,):
            notices.append(Notice("Deskfleet paused", f"Paused: {', '.join(reasons)}."))
    if after.state == "error" and before.state != "error":
        notices.append(Notice("Deskfleet error", after.worker.last_error or "the stage worker failed", "error"))
    return notices


def login_command(state_dir: Path, default_state_dir: Path) -> list[str]:
    """The command registered to start the tray at login: this interpreter running the CLI, so it
    works from a virtualenv as well; a non-default state dir is passed on so the same agent starts."""
    command = [sys.executable, "-m", "engine.cli.main", "agent"]
    if Path(state_dir).resolve() != Path(default_state_dir).resolve():
        command += ["--state-dir", str(Path(state_dir).resolve())]
    return command
