"""How many failovers the fleet's rings made today (the service PC's local day), for the
console's Dashboard: ``failovers_today`` in ``GET /admin/v1/metrics`` (docs/ADMIN_API.md).

Each ring's coordinator counts its own failovers since it started (``failovers_total``); a ring
re-formed after a failure, or a restarted service, starts again from 0. `FailoverTally` turns
those per-coordinator counters into a count per day: it is shown every metrics sample the
service takes and adds what each ring's counter grew by since the last (a counter that went
down is a new coordinator: all of its count is new; a ring missing from a sample keeps its last
figure, so one that comes back is not counted twice). The day's count survives a service
restart in the state database (a setting); a failover of a ring that ends before the next sample
(at most the metrics interval, a few seconds) is not counted.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from console.fleet.errors import FleetStateError
from console.fleet.fleet_state import fleet_db

log = logging.getLogger("deskfleet.fleet")

SETTING = "failover_tally"
WHAT = "the failover tally"


class FailoverTally:
    """``observe(metrics_by_ring)`` with each sample; ``today()`` answers the count, kept in the
    state database of ``state_dir`` (None: in memory only)."""

    def __init__(self, state_dir: Path | None, clock: Callable[[], dt.date] = dt.date.today) -> None:
        self._path = state_dir
        self._clock = clock
        self._seen: dict[str, float] = {}  # ring -> its coordinator's failovers_total last sample
        self._day, self._count = clock(), 0
        if state_dir is not None:
            self._load(state_dir)

    def _load(self, path: Path) -> None:
        try:
            data = fleet_db(path).setting(SETTING)
        except FleetStateError as exc:
            log.warning("%s; counting today's failovers from 0", exc)
            return
        if isinstance(data, dict) and data.get("day") == self._day.isoformat() and isinstance(data.get("count"), int):
            self._count = max(0, data["count"])

    def today(self) -> int:
        self._roll()
        return self._count

    def observe(self, metrics: Mapping[str, Mapping[str, float]]) -> int:
        """Take one sample (ring id -> its coordinator's metrics); today's count after it."""
        self._roll()
        grew = 0
        for ring, sample in metrics.items():
            total = sample.get("failovers_total")
            if not isinstance(total, (int, float)):
                continue
            last = self._seen.get(ring, 0.0)
            grew += int(total - last) if total >= last else int(total)
            self._seen[ring] = float(total)
        if grew > 0:
            self._count += grew
            self._save()
        return self._count

    def _roll(self) -> None:
        today = self._clock()
        if today != self._day:
            self._day, self._count = today, 0

    def _save(self) -> None:
        if self._path is None:
            return
        try:
            fleet_db(self._path).set_setting(SETTING, {"day": self._day.isoformat(), "count": self._count})
        except FleetStateError as exc:
            log.warning("could not save %s in %s: %s", WHAT, self._path, exc)
