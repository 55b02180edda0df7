"""Who used the API how much, and whether a key may use more: usage per request and token budgets.

Every completion request is recorded when it ends (:meth:`UsageLedger.record`): its key (a person
or an application), the key's group, the model and ring, prompt and completion tokens, the time to
its first token, its duration and status; never its text. The rows live in the state database
(:mod:`engine.state.db`) beside the keys; ``deskfleet usage`` and the admin API's ``GET /usage``
add them up by key, model or day.

Budgets: a key (``day_tokens`` / ``month_tokens`` on its record) and a group (``deskfleet keys
group``) may each have a token budget per UTC day and per UTC month. A request whose key or group
has used its budget is refused before it starts (429 ``budget_exceeded``, the reset time in the
message and ``Retry-After``); from :data:`WARN_AT` of a budget on, answers carry the
:data:`WARNING_HEADER` a chat shows. A request that starts under budget runs to its end (its
tokens are counted when it ends; the per-minute ``tpm`` limit is what stops a stream mid-way).

Growth is bounded: rows older than ``raw_days`` are folded into one row per day, key, model and
ring, and those are kept ``daily_days`` (:meth:`UsageLedger.roll_up`, at most hourly, off the loop).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.api.keys import Caller
from engine.errors import DeskfleetError
from engine.state.db import StateDB, StateDBError, UsageRecord

log = logging.getLogger("deskfleet.api.usage")

WARN_AT = 0.8  # share of a budget from which answers carry the warning
WARNING_HEADER = "X-Deskfleet-Budget-Warning"
RAW_DAYS = 35  # per-request rows kept this long (a month and its budget), then folded into days
DAILY_DAYS = 400  # per-day rows kept this long (a year and a month, to compare with last year)
ROLL_UP_EVERY_S = 3600.0
PERIOD_WORDS = {"day": "daily", "month": "monthly"}


def periods(now: dt.datetime) -> dict[str, str]:
    """The UTC day and month ``now`` falls in, as the totals name them: {"day": "2026-12-07", "month": "2026-12"}."""
    now = now.astimezone(dt.UTC)
    return {"day": now.strftime("%Y-%m-%d"), "month": now.strftime("%Y-%m")}


def resets_at(period: str, now: dt.datetime) -> dt.datetime:
    """When the budget ``period`` ("day" / "month") that holds ``now`` starts again (UTC midnight)."""
    now = now.astimezone(dt.UTC)
    day = dt.datetime(now.year, now.month, now.day, tzinfo=dt.UTC)
    if period == "day":
        return day + dt.timedelta(days=1)
    return dt.datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class Budget:
    """One budget as it stands: whose (``scope`` "key" or "group", and its ``name``), which period,
    its limit and what was used of it, and when it starts again."""

    scope: str
    name: str
    period: str
    limit: int
    used: int
    resets: dt.datetime

    @property
    def share(self) -> float:
        return self.used / self.limit

    def _what(self) -> str:
        whose = f"the key {self.name!r}" if self.scope == "key" else f"the group {self.name!r}"
        return f"the {PERIOD_WORDS[self.period]} budget of {whose} ({self.limit} tokens)"

    def _reset(self) -> str:
        return self.resets.strftime("%Y-%m-%dT%H:%M:%SZ")

    def refusal(self) -> str:
        return (f"{self._what()} is used up ({self.used} tokens); it resets at {self._reset()} (UTC). Ask the "
                "fleet's admin for a larger budget if you need more before then")

    def warning(self) -> str:
        """The warning header's text (ASCII: it is an HTTP header)."""
        return f"{math.floor(self.share * 100)}% of {self._what()} used; it resets at {self._reset()}"

    def retry_after(self, now: dt.datetime) -> float:
        return max(1.0, (self.resets - now).total_seconds())


@dataclass(frozen=True)
class Verdict:
    """What the budgets say of a request: ``over`` refuses it; ``warning`` (80 % or more) is shown."""

    over: Budget | None = None
    warning: Budget | None = None


def judge(budgets: list[Budget]) -> Verdict:
    """The first budget used up (the one that resets last, so ``Retry-After`` is honest), else the
    most used one at WARN_AT or more. Pure."""
    over = [b for b in budgets if b.used >= b.limit]
    if over:
        return Verdict(over=max(over, key=lambda b: b.resets))
    near = [b for b in budgets if b.share >= WARN_AT]
    return Verdict(warning=max(near, key=lambda b: b.share) if near else None)


class UsageLedger:
    """The API's usage rows and budgets in the state database ``db`` (see the module docstring)."""

    def __init__(self, db: Callable[[], StateDB], *, raw_days: float = RAW_DAYS, daily_days: float = DAILY_DAYS,
                 clock: Callable[[], float] = time.time) -> None:
        if raw_days < 1 or daily_days < raw_days:
            raise ValueError(f"usage retention: raw_days ({raw_days}) must be at least 1 and daily_days "
                             f"({daily_days}) at least raw_days")
        self._db = db
        self.raw_days, self.daily_days = raw_days, daily_days
        self._clock = clock
        self._rolled_at = -math.inf

    def _now(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self._clock(), dt.UTC)

    def budgets(self, caller: Caller) -> list[Budget]:
        """Every budget that applies to ``caller``, with what is used of it now."""
        now, db = self._now(), self._db()
        named = periods(now)
        limits = [("key", caller.name, "day", caller.day_tokens), ("key", caller.name, "month", caller.month_tokens)]
        if caller.group:
            group = db.key_groups().get(caller.group, {})
            limits += [("group", caller.group, p, group.get(f"{p}_tokens")) for p in ("day", "month")]
        return [Budget(scope, name, period, limit, db.tokens_used(f"{scope}:{name}", named[period]),
                       resets_at(period, now))
                for scope, name, period, limit in limits if limit]

    def check(self, caller: Caller) -> Verdict:
        """The request's verdict; a database that cannot be read refuses nothing (the key check
        already refuses every key when the book cannot be read)."""
        if not (caller.day_tokens or caller.month_tokens or caller.group):
            return Verdict()
        try:
            return judge(self.budgets(caller))
        except StateDBError as exc:
            log.warning("budgets not checked: %s", exc)
            return Verdict()

    def record(self, caller: Caller, *, model: str, ring: str, prompt_tokens: int, completion_tokens: int,
               ttft_s: float | None, duration_s: float, status: int) -> bool:
        """Record one finished request (one small transaction); True when a roll-up is due."""
        now = self._now()
        record = UsageRecord(at=now.timestamp(), key=caller.name, model=model or "", ring=ring or "",
                             prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             ttft_ms=None if ttft_s is None else round(ttft_s * 1000, 1),
                             duration_ms=round(duration_s * 1000, 1), status=status, group=caller.group)
        try:
            self._db().record_usage(record, tuple(periods(now).values()))
        except StateDBError as exc:  # the answer was given; its usage row is what is lost
            log.warning("usage of a request by %r not recorded: %s", caller.name, exc)
        if self._clock() - self._rolled_at >= ROLL_UP_EVERY_S:
            self._rolled_at = self._clock()
            return True
        return False

    def roll_up(self) -> int:
        """Fold and drop what the retention says (see the module docstring); the rows folded."""
        now = self._now()
        midnight = dt.datetime(now.year, now.month, now.day, tzinfo=dt.UTC)
        raw_before = midnight - dt.timedelta(days=math.ceil(self.raw_days))
        daily_before = midnight - dt.timedelta(days=math.ceil(self.daily_days))
        yesterday = midnight - dt.timedelta(days=1)
        last_month = dt.datetime(now.year - (now.month == 1), (now.month - 2) % 12 + 1, 1, tzinfo=dt.UTC)
        folded = self._db().roll_up_usage(raw_before.timestamp(), daily_before.strftime("%Y-%m-%d"),
                                          (yesterday.strftime("%Y-%m-%d"), last_month.strftime("%Y-%m")))
        if folded:
            log.info("usage: %d request rows before %s folded into days", folded, raw_before.date())
        return folded


# -- reading it back ---------------------------------------------------------------------------

BY = ("key", "model", "day", "ring")
DEFAULT_SINCE = "30d"
_AGO = re.compile(r"(\d+(?:\.\d+)?)\s*([dhm])")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0}


def parse_since(text: str, now: float | None = None) -> float:
    """Unix time of ``text``: an age (``7d``, ``24h``, ``90m``) or a UTC date or time (ISO 8601)."""
    now = time.time() if now is None else now
    if m := _AGO.fullmatch(text.strip()):
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise DeskfleetError(f"--since {text!r} is neither an age (7d, 24h, 90m) nor a date (2026-12-01)") from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


def summary(state_dir: Path, by: str, since: float, key: str | None = None) -> list[dict[str, Any]]:
    """The usage added up by ``by`` since ``since`` as JSON rows (``deskfleet usage``, ``GET /usage``)."""
    return [r.to_json() for r in StateDB.for_dir(state_dir).usage_summary(by, since, key)]  # type: ignore[arg-type]
