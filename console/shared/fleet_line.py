"""The one line above a chat's input that says whether the fleet can answer now, and if not, why.

Pure: built from what the fleet's API said, its ``/health`` report (every ring's status, and for
a ring that is recovering or down the stage and the reason, e.g. "stage 1 on pc-b is paused
(paused by the user)") or the :class:`~console.shared.chat_model.ChatError` of the last call (no
answer at all, or a refusal with its status). The chat window shows it and colours it by level.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from console.shared.chat_model import ChatError

OK, WAITING, PAUSED, DOWN, UNREACHABLE, REFUSED = "ok", "waiting", "paused", "down", "unreachable", "refused"
COLOURS = {OK: "#1e7d32", WAITING: "#7a4f00", PAUSED: "#7a4f00", DOWN: "#9c1f17", UNREACHABLE: "#9c1f17",
           REFUSED: "#9c1f17"}
BACKGROUNDS = {OK: "#e8f5e9", WAITING: "#fff3d6", PAUSED: "#fff3d6", DOWN: "#fde7e5", UNREACHABLE: "#fde7e5",
               REFUSED: "#fde7e5"}


@dataclass(frozen=True)
class FleetLine:
    level: str  # one of OK, WAITING, PAUSED, DOWN, UNREACHABLE, REFUSED
    text: str

    @property
    def ok(self) -> bool:
        return self.level == OK

    @property
    def colour(self) -> str:
        return COLOURS[self.level]

    @property
    def background(self) -> str:
        return BACKGROUNDS[self.level]


def _is_pause(detail: str) -> bool:
    return " paused" in detail or detail.startswith("paused")


def from_health(status: int, doc: Mapping[str, Any]) -> FleetLine:
    """The line for a ``/health`` answer (``status`` its HTTP status, ``doc`` its JSON)."""
    rings = [r for r in doc.get("rings") or () if isinstance(r, Mapping)]
    troubled = [r for r in rings if r.get("status") != "ok"]
    if not rings:
        return FleetLine(DOWN, "The fleet serves no model yet: the admin has to place and distribute one "
                               "before the chat can answer.")
    if not troubled and status == 200:
        models = sorted({str(r.get("model")) for r in rings})
        return FleetLine(OK, f"The fleet is ready ({', '.join(models)}).")
    reasons = "; ".join(f"{r.get('model')}: {r.get('detail') or r.get('status')}" for r in troubled)
    paused = any(_is_pause(str(r.get("detail") or "")) for r in troubled)
    if status == 503:
        if paused:
            return FleetLine(PAUSED, f"The fleet is paused and cannot answer now — {reasons}. Answers resume "
                                     "when that PC is free again or a spare PC takes its part.")
        return FleetLine(DOWN, f"The fleet cannot answer now — {reasons}.")
    if paused:
        which = "The fleet is paused" if len(troubled) == len(rings) else "Part of the fleet is paused"
        return FleetLine(PAUSED, f"{which} — {reasons}. Answers wait until that PC is free again or another "
                                 "PC takes its part.")
    return FleetLine(WAITING, f"The fleet is recovering — {reasons}. Answers continue once it is back.")


def from_error(error: ChatError) -> FleetLine:
    """The line for a failed call to the fleet's API."""
    text = str(error)
    if error.unreachable:
        return FleetLine(UNREACHABLE, f"The fleet is unreachable — {text}.")
    if error.status in (401, 403):
        return FleetLine(REFUSED, f"The fleet refused this chat's API key: {text}. Ask the admin for a key, "
                                  "or rejoin this PC.")
    if error.status == 429:
        return FleetLine(WAITING, f"The fleet is busy: {text}.")
    if error.status == 503:
        paused = _is_pause(text)
        return FleetLine(PAUSED if paused else DOWN, f"The fleet cannot answer now: {text}.")
    return FleetLine(DOWN, f"The fleet could not answer: {text}.")
