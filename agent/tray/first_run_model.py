"""What the agent's first-run window says, decided without Qt.

An agent that is not in a fleet asks for one thing: the join token. The console's address is
found on the network (:mod:`engine.discovery.join_service`); typing it is the fallback for a console
on another network. Once joined, the window says the PC waits for the admin's approval, and
changes when the console gives it work. Every page first says, in plain words, what the app
will do with the PC. Pure functions of the search result and the agent's status, tested
without a QApplication; :mod:`agent.tray.join_dialog` only shows them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.control.messages import AgentStatus
from engine.discovery.join_service import ConsoleAdvertisement

WHAT_IT_DOES = (
    "Deskfleet lends this PC's spare computing power to your organisation's own AI assistant, which "
    "runs on the office's PCs (nothing leaves the building). It works only while you are away from "
    "the keyboard and mouse, stops the moment you come back, and pauses on battery. You can "
    "pause it at any time from its icon in the tray. It does not read your files.")
TOKEN_PROMPT = "Paste the join token your admin gave you. That is all: the rest is found on the network."
NEED_TOKEN = "Enter the join token from your admin (it starts with DFJ1-)."
SEARCHING = "Looking for your fleet's console on this network…"
NONE_FOUND = ("No console answered on this network yet. If your admin's console is on another "
              "network, enter its address (shown next to the token).")


@dataclass(frozen=True)
class WaitingPage:
    headline: str
    detail: str
    approved: bool


def consoles_line(consoles: tuple[ConsoleAdvertisement, ...] | None) -> str:
    """The search's result in one sentence; ``None`` while still searching."""
    if consoles is None:
        return SEARCHING
    if not consoles:
        return NONE_FOUND
    if len(consoles) == 1:
        c = consoles[0]
        return f"Found the console of fleet {c.fleet_id} at {c.enrollment}."
    return f"Found {len(consoles)} consoles on this network; your token says which one is yours."


def show_address_field(consoles: tuple[ConsoleAdvertisement, ...] | None, asked: bool) -> bool:
    """The address field appears when the person asks for it or when no console was found."""
    return asked or consoles == ()


def join_request(token: str, address: str) -> tuple[str, str | None] | str:
    """(token, console address or None to find it) from the fields, or what to tell the person."""
    token, address = token.strip(), address.strip()
    if not token:
        return NEED_TOKEN
    return token, (address or None)


def waiting_page(status: AgentStatus | None) -> WaitingPage:
    """After the join: waiting for the admin's approval, or approved once work has arrived."""
    fleet = f"fleet {status.fleet_id[:16]}" if status is not None and status.fleet_id else "your fleet"
    if status is not None and status.export_id is not None:
        return WaitingPage(
            "Approved: this PC is part of the fleet",
            f"It holds part {(status.stage or 0) + 1} of a model and helps the fleet only while you are away. "
            "You can close this window; Deskfleet keeps working from the tray.", True)
    if status is not None and status.api_url:
        return WaitingPage(
            "Approved: this PC is part of the fleet",
            "Your admin approved it; it gets work when the fleet needs it, and only while you are away. "
            "Chat with the fleet from the tray menu (Open chat…).", True)
    return WaitingPage(
        "Joined — awaiting approval",
        f"This PC joined {fleet}. Your admin now approves it in the console and gives it its "
        "part of a model; until then nothing runs on it. You can close this window: Deskfleet "
        "waits in the tray.", False)
