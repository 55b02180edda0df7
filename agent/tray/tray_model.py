"""What the tray shows, decided without Qt: the status line, the menu's state, and which status
changes deserve a desktop notification.

Pure functions of :class:`engine.control.messages.AgentStatus` and the settings, so every rule is tested
without a QApplication; :mod:`agent.tray.tray` only copies the result onto its QActions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from agent.service import pause
from agent.service.settings import AgentSettings
from engine.control.messages import AgentStatus

STARTING = "starting"  # not an agent state: the tray's own, until the service's first status
STATUS_MAX_CHARS = 90
NO_CHAT_ADDRESS = ("The fleet has no chat address yet: it appears here once the console gives this PC "
                   "its part of a model.")


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


def _part(status: AgentStatus) -> str:
    if status.export_id is None:
        return ""
    return f"stage {status.stage} of {status.export_id}"


def status_line(status: AgentStatus | None) -> str:
    """One line for the top of the menu, e.g. "Serving stage 1 of tiny-2 · 12 steps/s"."""
    if status is None:
        return "Starting…"
    part = _part(status)
    if status.state == "not-joined":
        return "Not in a fleet: join one to lend this PC"
    if status.state == "paused":
        return _short(f"Paused: {', '.join(status.paused_reasons)}")
    if status.state == "error":
        return _short(f"Error: {status.worker.last_error or 'the stage worker failed'}")
    if status.state == "fetching":
        return _short(f"Fetching {part} · {status.fetch.fraction:.0%}")
    if status.state == "serving":
        speed = f" · {status.worker.steps_per_s:.0f} steps/s" if status.worker.state == "running" else " · starting"
        return _short(f"Serving {part}{speed}")
    if part:
        return _short(f"Ready: {part}")
    return "Idle: waiting for work from the fleet"


def menu_state(status: AgentStatus | None, settings: AgentSettings, start_at_login: bool) -> MenuState:
    joined = status is not None and status.state != "not-joined"
    manual = status is not None and pause.MANUAL in status.paused_reasons
    return MenuState(status=status_line(status), pause_text="Resume" if manual else "Pause",
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
        if reasons != (pause.IN_USE,) or before.state == "serving":
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
