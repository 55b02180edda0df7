"""The Fleet page's table as a Qt model, kept up to date by diffs of the bridge's records
snapshots rather than rebuilt.

The service sends the whole list (frozen `AgentRecord`s) on every change; with a thousand agents
changing state that is many snapshots a second, each a thousand rows. `diff_records` (pure)
says which rows went, which changed what they show, and which are new; `FleetTableModel.apply`
turns that into ``rowsRemoved`` / ``dataChanged`` / ``rowsInserted``, so the view repaints only
the rows on screen that changed and keeps its selection, sort and scroll position. The
`Coalescer` lets at most one snapshot through per interval (the newest one), so a burst of news
costs the GUI thread one apply.

Rows keep their first-seen order; sorting and the filter box are a `QSortFilterProxyModel` over
this model (``SORT_ROLE`` gives numbers for the numeric columns, ``FILTER_ROLE`` the text the
filter box searches: name, state and tags).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, QPersistentModelIndex, Qt, QTimer
from PySide6.QtGui import QColor

from console.fleet_api.agent_record import UNVERIFIED_STATE, AgentRecord, Membership
from console.fleet_api.link_report import SERVICE, LinkReport
from console.qt.fleet_overview import AWAITING

COLUMNS = ("Name", "State", "Tags", "Devices", "Memory", "Last seen", "Approved", "Address", "RTT ms", "Mbit/s")
LAST_SEEN = COLUMNS.index("Last seen")
RTT, MBIT = COLUMNS.index("RTT ms"), COLUMNS.index("Mbit/s")
RECORD_ROLE = Qt.ItemDataRole.UserRole + 1  # the row's AgentRecord (any column)
SORT_ROLE = Qt.ItemDataRole.UserRole + 2  # what the column sorts by (numbers where the text is a number)
FILTER_ROLE = Qt.ItemDataRole.UserRole + 3  # "name state tags", lower case (column 0)
COALESCE_MS = 250  # at most one snapshot applied per this long
STATE_COLOURS = {"unreachable": "#b3261e", "paused": "#9a6700", "not joined": "#5f6368", "other fleet": "#5f6368",
                 AWAITING: "#a142f4"}

Index = QModelIndex | QPersistentModelIndex
ROOT = QModelIndex()


def state_text(record: AgentRecord) -> str:
    if record.membership is not Membership.MEMBER:
        return "not joined" if record.membership is Membership.NOT_JOINED else "other fleet"
    if record.reachable is False:
        return "unreachable"
    if not record.approved and record.state != UNVERIFIED_STATE:
        # one name for it everywhere (the Dashboard, the banner, the tray): what the PC does meanwhile in brackets
        return AWAITING + (f" ({', '.join(record.paused_reasons)})" if record.paused and record.paused_reasons else "")
    if record.paused and record.paused_reasons:
        return f"paused ({', '.join(record.paused_reasons)})"
    return record.state


def ago(monotonic: float | None, now: float) -> str:
    if monotonic is None:
        return "never (saved)"
    seconds = max(0.0, now - monotonic)
    return "just now" if seconds < 2 else f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def looks(record: AgentRecord) -> tuple[Any, ...]:
    """What a row shows of ``record``, apart from "Last seen" (which moves on every snapshot and
    is redrawn by the clock instead): two records that look alike need no repaint."""
    return (record.name, record.membership, record.reachable, record.state, record.paused_reasons, record.tags,
            record.devices, record.memory_bytes, record.approved, record.address, record.control_port, record.error,
            record.tags_set_by, record.last_seen is None)


@dataclass(frozen=True)
class RecordsDiff:
    """From one list of rows to the next: remove ``removed`` (old row numbers), then repaint
    ``changed`` (row numbers after the removal), then append ``added``."""

    removed: tuple[int, ...]
    changed: tuple[int, ...]
    added: tuple[AgentRecord, ...]

    @property
    def empty(self) -> bool:
        return not (self.removed or self.changed or self.added)


def diff_records(old: Sequence[AgentRecord], new: Iterable[AgentRecord]) -> RecordsDiff:
    """The diff from the rows ``old`` to the snapshot ``new`` (rows matched by record key; the
    surviving rows keep their order, new ones go last in the snapshot's order)."""
    incoming = {r.key: r for r in new}
    removed = tuple(i for i, r in enumerate(old) if r.key not in incoming)
    changed, row = [], 0
    for r in old:
        after = incoming.pop(r.key, None)
        if after is None:
            continue
        if looks(after) != looks(r):
            changed.append(row)
        row += 1
    return RecordsDiff(removed, tuple(changed), tuple(incoming.values()))


def ranges(rows: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted row numbers as (first, last) runs: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    out: list[tuple[int, int]] = []
    for r in sorted(rows):
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


class FleetTableModel(QAbstractTableModel):
    """One row per agent record; ``apply(records)`` moves it to a new snapshot by diff."""

    def __init__(self, parent: QObject | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(parent)
        self._rows: list[AgentRecord] = []
        self._row_of: dict[str, int] = {}
        self._links: LinkReport | None = None
        self._clock = clock
        self.applied = 0  # snapshots applied (the Coalescer's effect is visible in tests)

    # ---- reading ---------------------------------------------------------------------------------

    def rowCount(self, parent: Index = ROOT) -> int:  # noqa: N802 (Qt's names)
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: Index = ROOT) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,  # noqa: N802
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation is Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def records(self) -> tuple[AgentRecord, ...]:
        return tuple(self._rows)

    def record(self, row: int) -> AgentRecord:
        return self._rows[row]

    def row_of(self, key: str) -> int | None:
        return self._row_of.get(key)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        r, col = self._rows[index.row()], index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return self._text(r, col)
        if role == SORT_ROLE:
            return self._sort_key(r, col)
        if role == RECORD_ROLE:
            return r
        if role == FILTER_ROLE:
            return " ".join((r.name, state_text(r), *r.tags)).lower()
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == 1 and r.error:
                return r.error
            if col == 2 and r.tags:
                return "set by the admin" if r.tags_set_by == "admin" else "as the agent reports them"
        if role == Qt.ItemDataRole.ForegroundRole and col == 1:
            colour = STATE_COLOURS.get(state_text(r).split(" (")[0])  # the state without its reasons
            return QColor(colour) if colour else None
        return None

    def _link(self, r: AgentRecord):
        return self._links.measured.get((SERVICE, r.node_id)) if self._links and r.node_id else None

    def _text(self, r: AgentRecord, col: int) -> str:
        if col == 0:
            return r.name
        if col == 1:
            return state_text(r)
        if col == 2:
            return ", ".join(r.tags)
        if col == 3:
            return ", ".join(r.devices) or "—"
        if col == 4:
            return f"{r.memory_bytes / 1e9:.1f} GB" if r.memory_bytes else "—"
        if col == LAST_SEEN:
            return ago(r.last_seen, self._clock())
        if col == 6:
            return "yes" if r.approved else "no"
        if col == 7:
            return r.control_address
        link = self._link(r)
        if link is None:
            return ""
        return f"{link.rtt_ms:.2f}" if col == RTT else f"{link.mbit_s:.0f}"

    def _sort_key(self, r: AgentRecord, col: int) -> Any:
        if col == 4:
            return r.memory_bytes
        if col == LAST_SEEN:
            return -1.0 if r.last_seen is None else r.last_seen
        if col in (RTT, MBIT):
            link = self._link(r)
            return -1.0 if link is None else (link.rtt_ms if col == RTT else link.mbit_s)
        return self._text(r, col).lower()

    # ---- writing ---------------------------------------------------------------------------------

    def apply(self, records: Sequence[AgentRecord]) -> RecordsDiff:
        """Move to the snapshot ``records``: removed rows removed, changed rows repainted, new
        rows appended. Rows that only moved on in time take the new record silently."""
        diff = diff_records(self._rows, records)
        for first, last in reversed(ranges(diff.removed)):
            self.beginRemoveRows(QModelIndex(), first, last)
            del self._rows[first:last + 1]
            self.endRemoveRows()
        incoming = {r.key: r for r in records}
        self._rows = [incoming[r.key] for r in self._rows]
        self._changed(diff.changed)
        if diff.added:
            start = len(self._rows)
            self.beginInsertRows(QModelIndex(), start, start + len(diff.added) - 1)
            self._rows.extend(diff.added)
            self.endInsertRows()
        if diff.removed or diff.added:
            self._row_of = {r.key: i for i, r in enumerate(self._rows)}
        self.applied += 1
        return diff

    def _changed(self, rows: Sequence[int], first_col: int = 0, last_col: int = len(COLUMNS) - 1) -> None:
        # one signal per run of rows, never one over their span: the sorting proxy re-sorts every
        # row a signal covers (a span over a thousand rows cost five times the whole apply)
        for first, last in ranges(rows):
            self.dataChanged.emit(self.index(first, first_col), self.index(last, last_col))

    def set_links(self, report: LinkReport | None) -> None:
        self._links = report
        if self._rows:
            self.dataChanged.emit(self.index(0, RTT), self.index(len(self._rows) - 1, MBIT))

    def tick(self) -> None:
        """The clock moved on: "Last seen" is redrawn (only its visible cells are painted)."""
        if self._rows:
            self.dataChanged.emit(self.index(0, LAST_SEEN), self.index(len(self._rows) - 1, LAST_SEEN))


class Coalescer(QObject):
    """``offer(value)`` as often as news comes; ``apply(value)`` runs with the newest value at most
    once per ``interval_ms``: at once after a quiet spell, else when the interval is up."""

    def __init__(self, apply: Callable[[Any], None], interval_ms: int = COALESCE_MS,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._apply = apply
        self._interval_s = interval_ms / 1000
        self._pending: Any = None
        self._has_pending = False
        self._last = float("-inf")
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.flush)

    def offer(self, value: Any) -> None:
        self._pending, self._has_pending = value, True
        if self._timer.isActive():
            return
        wait_s = self._last + self._interval_s - time.monotonic()
        if wait_s <= 0:
            self.flush()
        else:
            self._timer.start(max(1, int(wait_s * 1000)))

    def flush(self) -> None:
        """Apply the pending value now (nothing pending: nothing happens)."""
        if self._timer.isActive():
            self._timer.stop()
        if not self._has_pending:
            return
        value, self._pending, self._has_pending = self._pending, None, False
        self._last = time.monotonic()
        self._apply(value)
