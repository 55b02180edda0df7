"""The Fleet page: every agent the console knows, the join token to hand out (and the reusable
tokens behind "Join tokens…"), approval, pause, resume and removal of any number of selected
agents, adding an agent by address, and the links measured between them.

A thin view over `console.qt.fleet_table_model.FleetTableModel`: the bridge's ``records_changed``
snapshots are coalesced (at most one per ``COALESCE_MS``) and applied to the model by diff; a
`QSortFilterProxyModel` sorts and filters (name, state, tag). Buttons act on every selected agent
it applies to, through the bridge (a few calls in flight at a time), and say how it went.

A refresh makes as few Qt calls as it can (a label or button is set only when it changes): cheaper,
and under PySide6 6.12.0 on CPython 3.11 every call of a Qt method returning void drops a
reference to None (the interpreter aborts once they run out), so per-refresh calls add up.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from PySide6.QtCore import QItemSelection, QItemSelectionModel, QSortFilterProxyModel, Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.agent_record import AgentRecord, Membership
from console.fleet_api.link_report import SERVICE, LinkReport
from console.qt.confirm import ask_first
from console.qt.fleet_overview import awaiting_approval
from console.qt.fleet_table_model import (
    COALESCE_MS,
    FILTER_ROLE,
    SORT_ROLE,
    Coalescer,
    FleetTableModel,
    state_text,
)
from console.qt.service_bridge import ServiceBridge
from engine.control.messages import parse_hostport
from engine.errors import DeskfleetError

if TYPE_CHECKING:  # the dialog's module is loaded on first use (open_tokens)
    from console.qt.tokens_dialog import QtTokensDialog

IN_FLIGHT = 8  # calls of one batch action running at once (the service dials each agent)
TICK_MS = 2000  # "Last seen" redrawn this often
Action = Callable[..., None]  # bridge.approve / pause / resume / remove


def approvable(r: AgentRecord) -> bool:
    return r.membership is Membership.MEMBER and not r.approved


def pausable(r: AgentRecord) -> bool:
    return r.membership is Membership.MEMBER and not r.paused


def resumable(r: AgentRecord) -> bool:
    return r.membership is Membership.MEMBER and r.paused


class BatchAction:
    """One button press over many agents: ``action(key, on_result=, on_error=)`` for each, at most
    ``IN_FLIGHT`` at a time; ``done(ok, failures)`` on the GUI thread when every call has answered."""

    def __init__(self, action: Action, records: list[AgentRecord],
                 done: Callable[[int, list[tuple[str, str]]], None]) -> None:
        self._action, self._done = action, done
        self._queue = deque(records)
        self._running = 0
        self.ok = 0
        self.failures: list[tuple[str, str]] = []  # (agent name, why)
        self.total = len(records)

    def start(self) -> BatchAction:
        for _ in range(min(IN_FLIGHT, len(self._queue))):
            self._next()
        if not self.total:
            self._done(0, [])
        return self

    @property
    def finished(self) -> bool:
        return self.ok + len(self.failures) == self.total

    def _next(self) -> None:
        r = self._queue.popleft()
        self._running += 1
        self._action(r.key, on_result=lambda _: self._answered(None, r),
                     on_error=lambda exc: self._answered(exc, r))

    def _answered(self, exc: BaseException | None, r: AgentRecord) -> None:
        self._running -= 1
        if exc is None:
            self.ok += 1
        else:
            self.failures.append((r.name, str(exc)))
        if self._queue:
            self._next()
        elif self.finished:
            self._done(self.ok, self.failures)


class QtFleetPage(QWidget):
    def __init__(self, bridge: ServiceBridge, parent: QWidget | None = None, *,
                 coalesce_ms: int = COALESCE_MS) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.links: LinkReport | None = None
        self.model = FleetTableModel(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setSortRole(SORT_ROLE)
        self.proxy.setFilterRole(FILTER_ROLE)
        self.proxy.setFilterKeyColumn(0)
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.updates = Coalescer(self._apply, coalesce_ms, self)
        self.batch: BatchAction | None = None  # the last button press's calls
        self.confirmation: QMessageBox | None = None  # Remove's question, while it is asked
        self.tokens_dialog: QtTokensDialog | None = None  # once opened
        self._sized = False
        self._build()
        bridge.records_changed.connect(self.updates.offer)
        bridge.token_changed.connect(self.token_edit.setText)
        bridge.started.connect(lambda: self.enrollment_label.setText(bridge.enrollment))
        self._clock = QTimer(self)
        self._clock.setInterval(TICK_MS)
        self._clock.timeout.connect(self.model.tick)
        self._clock.start()
        self._apply(bridge.records)

    def _build(self) -> None:
        join = QGroupBox("Join a PC to this fleet")
        self.token_edit = QLineEdit()
        self.token_edit.setReadOnly(True)
        self.copy_button = QPushButton("Copy")
        self.copy_button.clicked.connect(self.copy_token)
        self.new_token_button = QPushButton("New token")
        self.new_token_button.clicked.connect(self.bridge.new_token)
        self.tokens_button = QPushButton("Join tokens…")
        self.tokens_button.setToolTip("Reusable join tokens: issue (uses, expiry, auto-approval), list, revoke")
        self.tokens_button.clicked.connect(self.open_tokens)
        self.enrollment_label = QLabel("starting…")
        self.enrollment_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row = QHBoxLayout()
        row.addWidget(QLabel("Join token:"))
        row.addWidget(self.token_edit, 1)
        for b in (self.copy_button, self.new_token_button, self.tokens_button):
            row.addWidget(b)
        row2 = QHBoxLayout()
        row2.addWidget(QLabel("Console address (for the tray's Join dialog):"))
        row2.addWidget(self.enrollment_label, 1)
        join_box = QVBoxLayout(join)
        join_box.addLayout(row)
        join_box.addLayout(row2)

        self.filter_edit = QLineEdit()
        self.filter_edit.setPlaceholderText("Filter by name, state or tag")
        self.filter_edit.setClearButtonEnabled(True)
        self.filter_edit.textChanged.connect(self._filter)
        self.count_label = QLabel()
        filters = QHBoxLayout()
        filters.addWidget(self.filter_edit, 1)
        filters.addWidget(self.count_label)

        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSortingEnabled(True)
        self.table.sortByColumn(0, Qt.SortOrder.AscendingOrder)
        self.table.setWordWrap(False)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Fixed)  # no per-row measuring
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 8)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        header.setStretchLastSection(True)
        self.table.selectionModel().selectionChanged.connect(self._update_buttons)

        self.approve_button = QPushButton("Approve")
        self.remove_button = QPushButton("Remove…")
        self.pause_button = QPushButton("Pause")
        self.resume_button = QPushButton("Resume")
        self.measure_button = QPushButton("Measure links")
        self.approve_button.clicked.connect(self.approve_selected)
        self.remove_button.clicked.connect(self.remove_selected)
        self.pause_button.clicked.connect(self.pause_selected)
        self.resume_button.clicked.connect(self.resume_selected)
        self.measure_button.clicked.connect(self.measure_links)
        self.address_edit = QLineEdit()
        self.address_edit.setPlaceholderText("host:port of an agent that mDNS does not find (port 7210 by default)")
        self.address_edit.returnPressed.connect(self.add_address)
        self.add_button = QPushButton("Add by address")
        self.add_button.clicked.connect(self.add_address)
        actions = QHBoxLayout()
        for b in (self.approve_button, self.pause_button, self.resume_button, self.remove_button, self.measure_button):
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
        box.addLayout(filters)
        box.addWidget(self.table, 1)
        box.addLayout(actions)
        box.addLayout(add)
        box.addWidget(self.links_label)
        box.addWidget(self.message)
        self._update_buttons()

    # ---- records -> rows -------------------------------------------------------------------------

    def _apply(self, records: tuple[AgentRecord, ...]) -> None:
        self.model.apply(records)
        if not self._sized and records:
            self._sized = True
            self.table.resizeColumnsToContents()  # once: measuring on every change costs a thousand rows
            state = self.table.fontMetrics().horizontalAdvance("awaiting approval (the PC is in use)") + 16
            self.table.setColumnWidth(1, max(self.table.columnWidth(1), state))  # states change after the sizing
        self._update_counts()
        self._update_buttons()

    def _filter(self, text: str) -> None:
        self.proxy.setFilterFixedString(text.strip())
        self._update_counts()

    def _update_counts(self) -> None:
        records = self.model.records()
        states = Counter(state_text(r).split(" (")[0] for r in records)
        shown = self.proxy.rowCount()
        text = f"{len(records)} agent{'s' if len(records) != 1 else ''}"
        if states:
            text += ": " + ", ".join(f"{n} {s}" for s, n in states.most_common())
        if shown != len(records):
            text = f"showing {shown} of " + text
        if self.count_label.text() != text:
            self.count_label.setText(text)

    # ---- selection -------------------------------------------------------------------------------

    def selected(self) -> list[AgentRecord]:
        rows = sorted(self.proxy.mapToSource(i).row() for i in self.table.selectionModel().selectedRows())
        return [self.model.record(r) for r in rows]

    def select(self, keys: set[str]) -> None:
        """Select the rows of the agents ``keys`` (record keys) that the filter shows."""
        selection = QItemSelection()
        last = self.model.columnCount() - 1
        for key in keys:
            row = self.model.row_of(key)
            if row is None:
                continue
            index = self.proxy.mapFromSource(self.model.index(row, 0))
            if index.isValid():
                selection.select(index, self.proxy.index(index.row(), last))
        self.table.selectionModel().select(selection, QItemSelectionModel.SelectionFlag.ClearAndSelect)

    def _update_buttons(self, *_: object) -> None:
        chosen = self.selected()
        for button, on in ((self.approve_button, any(map(approvable, chosen))), (self.remove_button, bool(chosen)),
                           (self.pause_button, any(map(pausable, chosen))),
                           (self.resume_button, any(map(resumable, chosen)))):
            if button.isEnabled() != on:  # per refresh: only what changed (each Qt call costs, see module doc)
                button.setEnabled(on)

    # ---- actions on the selection ----------------------------------------------------------------

    def approve_selected(self) -> None:
        self._run("Approved", "Approving", self.bridge.approve, [r for r in self.selected() if approvable(r)])

    def approve_waiting(self) -> None:
        """Approve every PC that waits for approval (the banner's "Approve all")."""
        waiting = awaiting_approval(self.bridge.records)  # the newest news, not the table (it lags by design)
        self.select({r.key for r in waiting})
        self._run("Approved", "Approving", self.bridge.approve, waiting)

    def pause_selected(self) -> None:
        self._run("Paused", "Pausing", self.bridge.pause, [r for r in self.selected() if pausable(r)])

    def resume_selected(self) -> None:
        self._run("Resumed", "Resuming", self.bridge.resume, [r for r in self.selected() if resumable(r)])

    def remove_selected(self) -> None:
        """Ask first (with the count); removing revokes the agents' certificates."""
        chosen = self.selected()
        if not chosen:
            return
        what = chosen[0].name if len(chosen) == 1 else f"{len(chosen)} agents"
        self.confirmation = ask_first(
            self, "Remove agents", f"Remove {what} from the fleet?",
            "A removed PC's certificate is revoked: it can only come back by joining again with a new token.",
            lambda: self._run("Removed", "Removing", self.bridge.remove, chosen),
            closed=lambda: setattr(self, "confirmation", None))

    def _run(self, done_verb: str, doing_verb: str, action: Action, records: list[AgentRecord]) -> None:
        if not records:
            self._say("None of the selected agents can be: select others.")
            return
        skipped = len(self.selected()) - len(records)
        note = f" ({skipped} selected agent(s) left out: nothing to do for them)" if skipped > 0 else ""
        self._say(f"{doing_verb} {len(records)} agent(s)…{note}")

        def done(ok: int, failures: list[tuple[str, str]]) -> None:
            text = f"{done_verb} {ok} of {len(records)} agent(s).{note}"
            if failures:
                shown = "; ".join(f"{name}: {why}" for name, why in failures[:5])
                more = f" (and {len(failures) - 5} more)" if len(failures) > 5 else ""
                text += f" {len(failures)} failed: {shown}{more}"
            self._say(text, error=bool(failures))

        self.batch = BatchAction(action, records, done).start()

    # ---- the other actions -----------------------------------------------------------------------

    def copy_token(self) -> None:
        QGuiApplication.clipboard().setText(self.token_edit.text())
        self._say(f"Join token copied. On the PC: tray menu → Join a fleet…, paste it, console "
                  f"address {self.bridge.enrollment}.")

    def open_tokens(self) -> None:
        """The reusable join tokens dialog (its module is loaded on first use)."""
        from console.qt.tokens_dialog import QtTokensDialog

        if self.tokens_dialog is None:
            self.tokens_dialog = QtTokensDialog(self.bridge, self)
        self.tokens_dialog.show()
        self.tokens_dialog.raise_()

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
                 for (a, b), m in report.measured.items() if SERVICE not in (a, b)]
        failures = [f"{names.get(b, b[:8])}: {why}" for (a, b), why in report.failures.items()]
        self.links_label.setText("\n".join(["Between agents: " + ("; ".join(pairs) or "—"), *failures]))
        self._say("Links measured.")
        self.model.set_links(report)

    def _links_failed(self, exc: BaseException) -> None:
        self.measure_button.setEnabled(True)
        self._error(exc)

    def _error(self, exc: BaseException) -> None:
        self._say(str(exc), error=True)

    def _say(self, text: str, error: bool = False) -> None:
        self.message.setStyleSheet("color: #b3261e;" if error else "")
        self.message.setText(text)
