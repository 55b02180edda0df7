"""The Fleet page: every agent the console knows, the join token to hand out, approval, pause and
resume, adding an agent by address, and the links measured between them.

A thin view: rows are redrawn from the bridge's ``records_changed`` snapshots (frozen
`AgentRecord`s); buttons call the bridge, which runs the action on the console's loop.
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.service.agent_record import AgentRecord, Membership
from console.service.links import CONSOLE, LinkReport
from console.service_bridge import ServiceBridge
from engine.control.messages import parse_hostport
from engine.errors import DeskfleetError

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


class QtFleetPage(QWidget):
    def __init__(self, bridge: ServiceBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.links: LinkReport | None = None
        self._build()
        bridge.records_changed.connect(self._fill)
        bridge.token_changed.connect(self.token_edit.setText)
        bridge.started.connect(lambda: self.enrollment_label.setText(bridge.enrollment))
        self._fill(bridge.records)

    def _build(self) -> None:
        join = QGroupBox("Join a PC to this fleet")
        self.token_edit = QLineEdit()
        self.token_edit.setReadOnly(True)
        self.copy_button = QPushButton("Copy")
        self.copy_button.clicked.connect(self.copy_token)
        self.new_token_button = QPushButton("New token")
        self.new_token_button.clicked.connect(self.bridge.new_token)
        self.enrollment_label = QLabel("starting…")
        self.enrollment_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row = QHBoxLayout()
        row.addWidget(QLabel("Join token:"))
        row.addWidget(self.token_edit, 1)
        row.addWidget(self.copy_button)
        row.addWidget(self.new_token_button)
        row2 = QHBoxLayout()
        row2.addWidget(QLabel("Console address (for the tray's Join dialog):"))
        row2.addWidget(self.enrollment_label, 1)
        join_box = QVBoxLayout(join)
        join_box.addLayout(row)
        join_box.addLayout(row2)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.itemSelectionChanged.connect(self._update_buttons)

        self.approve_button = QPushButton("Approve")
        self.remove_button = QPushButton("Remove")
        self.pause_button = QPushButton("Pause")
        self.resume_button = QPushButton("Resume")
        self.measure_button = QPushButton("Measure links")
        self.approve_button.clicked.connect(lambda: self._each(self.bridge.approve))
        self.remove_button.clicked.connect(lambda: self._each(self.bridge.remove))
        self.pause_button.clicked.connect(lambda: self._each(self.bridge.pause))
        self.resume_button.clicked.connect(lambda: self._each(self.bridge.resume))
        self.measure_button.clicked.connect(self.measure_links)
        self.address_edit = QLineEdit()
        self.address_edit.setPlaceholderText("host:port of an agent that mDNS does not find (port 7210 by default)")
        self.address_edit.returnPressed.connect(self.add_address)
        self.add_button = QPushButton("Add by address")
        self.add_button.clicked.connect(self.add_address)
        actions = QHBoxLayout()
        for b in (self.approve_button, self.remove_button, self.pause_button, self.resume_button, self.measure_button):
            actions.addWidget(b)
        actions.addStretch(1)
        add = QHBoxLayout()
        add.addWidget(self.address_edit, 1)
        add.addWidget(self.add_button)

        self.links_label = QLabel()
        self.links_label.setWordWrap(True)
        self.message = QLabel()
        self.message.setWordWrap(True)
        box = QVBoxLayout(self)
        box.addWidget(join)
        box.addWidget(self.table, 1)
        box.addLayout(actions)
        box.addLayout(add)
        box.addWidget(self.links_label)
        box.addWidget(self.message)
        self._update_buttons()

    # ---- actions ---------------------------------------------------------------------------------

    def copy_token(self) -> None:
        QGuiApplication.clipboard().setText(self.token_edit.text())
        self._say(f"Join token copied. On the PC: tray menu → Join a fleet…, paste it, console "
                  f"address {self.bridge.enrollment}.")

    def selected(self) -> list[AgentRecord]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()})
        return [self.table.item(r, 0).data(Qt.ItemDataRole.UserRole) for r in rows]

    def select(self, keys: set[str]) -> None:
        """Select the rows of the agents ``keys`` (record keys)."""
        self.table.clearSelection()
        mode = self.table.selectionMode()
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.MultiSelection)
        for r in range(self.table.rowCount()):
            if self.table.item(r, 0).data(Qt.ItemDataRole.UserRole).key in keys:
                self.table.selectRow(r)
        self.table.setSelectionMode(mode)

    def _each(self, action) -> None:
        for record in self.selected():
            action(record.key, on_result=lambda _: None, on_error=self._error)

    def add_address(self) -> None:
        try:
            host, port = parse_hostport(self.address_edit.text().strip(), "the agent's address")
        except DeskfleetError as exc:
            self._error(exc)
            return
        self.bridge.add_address(host, port, on_result=lambda r: self._say(f"Added {r.name}."), on_error=self._error)

    def measure_links(self) -> None:
        members = [r for r in (self.selected() or self.bridge.records)
                   if r.membership is Membership.MEMBER and r.node_id]
        if not members:
            self._say("No member agent to measure: join and select agents first.")
            return
        self.measure_button.setEnabled(False)
        self._say(f"Measuring the links to {len(members)} agent(s)…")
        self.bridge.measure_links([r.node_id for r in members], self._links_done, self._links_failed)

    def _links_done(self, report: LinkReport) -> None:
        self.links = report
        self.measure_button.setEnabled(True)
        names = self.bridge.names()
        pairs = [f"{names.get(a, a[:8])} ↔ {names.get(b, b[:8])}: {m.rtt_ms:.2f} ms RTT, {m.mbit_s:.0f} Mbit/s"
                 for (a, b), m in report.measured.items() if CONSOLE not in (a, b)]
        failures = [f"{names.get(b, b[:8])}: {why}" for (a, b), why in report.failures.items()]
        self.links_label.setText("\n".join(["Between agents: " + ("; ".join(pairs) or "—"), *failures]))
        self._say("Links measured.")
        self._fill(self.bridge.records)

    def _links_failed(self, exc: BaseException) -> None:
        self.measure_button.setEnabled(True)
        self._error(exc)

    def _error(self, exc: BaseException) -> None:
        self._say(str(exc), error=True)

    def _say(self, text: str, error: bool = False) -> None:
        self.message.setStyleSheet("color: #b3261e;" if error else "")
        self.message.setText(text)

    # ---- records -> rows -------------------------------------------------------------------------

    def _fill(self, records: tuple[AgentRecord, ...]) -> None:
        keep = {r.key for r in self.selected()}
        self.table.setRowCount(len(records))
        for row, r in enumerate(records):
            link = self.links.measured.get((CONSOLE, r.node_id)) if self.links and r.node_id else None
            values = (r.name, _state(r), ", ".join(r.devices) or "—",
                      f"{r.memory_bytes / 1e9:.1f} GB" if r.memory_bytes else "—", _ago(r.last_seen),
                      "yes" if r.approved else "no", r.control_address,
                      f"{link.rtt_ms:.2f}" if link else "", f"{link.mbit_s:.0f}" if link else "")
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
        self.approve_button.setEnabled(any(not r.approved for r in members))
        self.remove_button.setEnabled(bool(chosen))
        self.pause_button.setEnabled(any(not r.paused for r in members))
        self.resume_button.setEnabled(any(r.paused for r in members))
