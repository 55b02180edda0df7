"""The join-token list as the console shows it: pure rows from the service's ``GET /tokens``
answer (no Qt), and the Issue form's choices turned into the admin API's options.

A row says what the admin needs to decide: the label (or the id when there is none), uses,
used, left, when it expires (or "never"), whether it auto-approves, its state, and the names of
the PCs it admitted.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

COLUMNS = ("Label", "Id", "Uses", "Used", "Left", "Expires", "Auto-approve", "State", "Admitted")
STATE_TEXT = {"active": "active", "used_up": "used up", "expired": "expired", "revoked": "revoked"}
# (text, seconds or None for no expiry): the Issue form's expiry choices, the default first
EXPIRY_CHOICES: tuple[tuple[str, float | None], ...] = (
    ("1 day", 24 * 3600.0), ("1 hour", 3600.0), ("7 days", 7 * 24 * 3600.0), ("30 days", 30 * 24 * 3600.0),
    ("never", None))


class TokenFormError(ValueError):
    """The Issue form holds a choice the service would refuse (said before anything is sent)."""


@dataclass(frozen=True)
class TokenRow:
    token_id: str
    cells: tuple[str, ...]  # in COLUMNS order
    active: bool  # revocable


def expiry_text(expires_at: float | None, now: float) -> str:
    if expires_at is None:
        return "never"
    when = dt.datetime.fromtimestamp(expires_at).strftime("%Y-%m-%d %H:%M")
    left = expires_at - now
    if left <= 0:
        return f"{when} (past)"
    if left < 3600:
        return f"{when} (in {max(1, int(left // 60))} min)"
    if left < 48 * 3600:
        return f"{when} (in {int(left // 3600)} h)"
    return f"{when} (in {int(left // 86400)} d)"


def token_rows(tokens: Sequence[Mapping[str, Any]], now: float) -> tuple[TokenRow, ...]:
    """The table's rows, in the service's order (newest first)."""
    rows = []
    for t in tokens:
        names = [str(a.get("name", "?")) for a in t.get("admitted", ())]
        count = int(t.get("admitted_count", len(names)))  # an event carries only the newest admissions
        admitted = ", ".join(names[:6]) + (f" and {count - len(names[:6])} more" if count > 6 else "")
        state = str(t.get("state", "?"))
        rows.append(TokenRow(str(t["id"]), (
            str(t.get("label") or "—"), str(t["id"]), str(t.get("uses", "?")), str(t.get("used", "?")),
            str(t.get("uses_left", "?")), expiry_text(t.get("expires_at"), now),
            "yes" if t.get("auto_approve") else "no", STATE_TEXT.get(state, state), admitted or "—"),
            state == "active"))
    return tuple(rows)


def issue_options(uses: int, expiry_index: int, auto_approve: bool, label: str) -> dict[str, Any]:
    """The admin client's ``async_issue_token`` keywords for the form's choices."""
    if not 0 <= expiry_index < len(EXPIRY_CHOICES):
        raise TokenFormError(f"no expiry choice {expiry_index}")
    ttl_s = EXPIRY_CHOICES[expiry_index][1]
    if auto_approve and ttl_s is None:
        raise TokenFormError("an auto-approving token must expire: choose an expiry, or untick auto-approve")
    if uses < 1:
        raise TokenFormError("a token admits at least one PC")
    return {"uses": int(uses), "ttl_s": ttl_s, "auto_approve": bool(auto_approve), "label": label.strip()}
