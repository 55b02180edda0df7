"""The Fleet page and the bridge's records feed as they were before the Qt model (session 10),
kept for the console-fleet benchmark's "old" variant only: the page rebuilt every row of a
`QTableWidget` from each snapshot (and re-selected the rows by scanning them), and the bridge
decoded every records snapshot of the service's feed on the GUI thread.

Only what a refresh costs is kept (the table, the selection, the buttons' enabling); the rest of
the page is the same as the new one's and does not run per refresh.
"""

from __future__ import annotations

import asyncio
import time

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.admin_client import AdminApiError, ServiceUnreachableError
from console.fleet_api.admin_decode import agents_from_json
from console.fleet_api.agent_record import AgentRecord, Membership
from console.fleet_api.feed import Event
from console.qt.service_bridge import RETRY_S, ServiceBridge, log

COLUMNS = ("Name", "State", "Devices", "Memory", "Last seen", "Approved", "Address", "RTT ms", "Mbit/s")


def _ago(monotonic: float | None) -> str:
    if monotonic is None:
        return "never (saved)"
    seconds = max(0, time.monotonic() - monotonic)
    return "just now" if seconds < 2 else f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def _state(record: AgentRecord) -> str:
    if record.membership is not Membership.MEMBER:
        return "not joined" if record.membership is Membership.NOT_JOINED else "other fleet"
    if record.reachable is False:
        return "unreachable"
    if record.paused and record.paused_reasons:
        return f"paused ({', '.join(record.paused_reasons)})"
    return record.state


class OldBridge(ServiceBridge):
    """The feed as it was: every event posted to the GUI thread, records decoded there."""

    async def _async_follow(self) -> None:
        after, away = 0, False
        while True:
            try:
                batch = await self.client.async_events(after)
            except AdminApiError as exc:
                if not away:
                    log.warning("lost the fleet service's event feed (%s); retrying", exc)
                away = True
                after = 0 if isinstance(exc, ServiceUnreachableError) else after
                await asyncio.sleep(RETRY_S)
                continue
            away = False
            after = batch.next
            for event in batch.events:
                self._post(self._on_event, event)

    def _on_event(self, event: Event) -> None:  # GUI thread
        if event.kind == "records":
            if not self._closed:
                self._apply_records(agents_from_json(event.data))
                self.service_event.emit(event)
            return
        super()._on_event(event)


class OldFleetPage(QWidget):
    """The old page's table: every snapshot rebuilds every row."""

    def __init__(self, bridge: ServiceBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.buttons = {name: QPushButton(name) for name in ("Approve", "Remove", "Pause", "Resume")}
        box = QVBoxLayout(self)
        box.addWidget(self.table, 1)
        for b in self.buttons.values():
            box.addWidget(b)
        bridge.records_changed.connect(self._fill)
        self._fill(bridge.records)

    def selected(self) -> list[AgentRecord]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()})
        return [self.table.item(r, 0).data(Qt.ItemDataRole.UserRole) for r in rows]

    def select(self, keys: set[str]) -> None:
        self.table.clearSelection()
        mode = self.table.selectionMode()
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.MultiSelection)
        for r in range(self.table.rowCount()):
            if self.table.item(r, 0).data(Qt.ItemDataRole.UserRole).key in keys:
                self.table.selectRow(r)
        self.table.setSelectionMode(mode)

    def _fill(self, records: tuple[AgentRecord, ...]) -> None:
        keep = {r.key for r in self.selected()}
        self.table.setRowCount(len(records))
        for row, r in enumerate(records):
            values = (r.name, _state(r), ", ".join(r.devices) or "—",
                      f"{r.memory_bytes / 1e9:.1f} GB" if r.memory_bytes else "—", _ago(r.last_seen),
                      "yes" if r.approved else "no", r.control_address, "", "")
            for col, value in enumerate(values):
                item = QTableWidgetItem(value)
                if col == 0:
                    item.setData(Qt.ItemDataRole.UserRole, r)
                if col == 1 and r.error:
                    item.setToolTip(r.error)
                self.table.setItem(row, col, item)
        self.select(keep)
        self._update_buttons()

    def _update_buttons(self) -> None:
        chosen = self.selected()
        members = [r for r in chosen if r.membership is Membership.MEMBER]
        self.buttons["Approve"].setEnabled(any(not r.approved for r in members))
        self.buttons["Remove"].setEnabled(bool(chosen))
        self.buttons["Pause"].setEnabled(any(not r.paused for r in members))
        self.buttons["Resume"].setEnabled(any(r.paused for r in members))
