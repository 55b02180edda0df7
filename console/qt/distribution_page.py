"""The Distribution page: bring the current plan up on the fleet. Distribute exports (or reuses)
the model with the plan's split, sends every agent its stage with a progress bar each, starts
the ring and shows its health; after a failure, Re-run resumes (verified shards are not sent
again); Stop takes the ring down. Under the table the ring is drawn live
(:mod:`console.qt.ring_diagram`): every stage's box with the agent's state and, once the ring
serves, the coordinator's measured ms per stage beside the prediction; the slowest in red.

A thin view over :class:`console.qt.service_serving.ServiceServing`'s signals.
"""

from __future__ import annotations

from collections.abc import Mapping

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.exports import ExportEvent, ExportFinished, ExportProgress
from console.fleet_api.ring_status import AgentProgress, RingHealth
from console.qt.confirm import ask_first
from console.qt.ring_diagram import QtRingDiagram, RingDiagram, measured_from_metrics
from console.qt.service_serving import ServiceServing, ServingPhase
from console.qt.session import PLAN, SERVING, ConsoleSession

COLUMNS = ("Agent", "Stage", "Phase", "Progress", "Error")


class QtDistributionPage(QWidget):
    def __init__(self, serving: ServiceServing, session: ConsoleSession, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.serving = serving
        self.session = session
        self.confirmation: QMessageBox | None = None  # the question before cutting off users' chats
        self.rows: dict[tuple[str, int], int] = {}  # (agent, stage) -> table row
        self.measured: dict[int, float] = {}  # stage -> the last measured ms of the ring serving now
        self._build()
        serving.export_event.connect(self._on_export)
        serving.progress.connect(self._on_progress)
        serving.health.connect(self._on_health)
        serving.failed.connect(self._on_failed)
        serving.phase_changed.connect(self._on_phase)
        serving.metrics.connect(self._on_metrics)
        serving.bridge.records_changed.connect(lambda _: self._draw_ring())
        session.subscribe(self._on_session)

    def _build(self) -> None:
        self.plan_label = QLabel()
        self.plan_label.setWordWrap(True)
        self.distribute_button = QPushButton("Distribute")
        self.distribute_button.clicked.connect(self.distribute)
        self.rerun_button = QPushButton("Re-run")
        self.rerun_button.clicked.connect(self.serving.rerun)
        self.cancel_button = QPushButton("Cancel export")
        self.cancel_button.clicked.connect(self.serving.cancel_export)
        self.stop_button = QPushButton("Stop serving")
        self.stop_button.clicked.connect(self.stop)
        buttons = QHBoxLayout()
        for b in (self.distribute_button, self.rerun_button, self.cancel_button, self.stop_button):
            buttons.addWidget(b)
        buttons.addStretch(1)

        self.export_bar = QProgressBar()
        self.export_bar.setRange(0, 1000)
        self.export_label = QLabel("Export: —")
        export = QHBoxLayout()
        export.addWidget(self.export_label)
        export.addWidget(self.export_bar, 1)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.health_label = QLabel("Ring: not started.")
        self.health_label.setWordWrap(True)
        self.error_label = QLabel()
        self.error_label.setWordWrap(True)
        self.error_label.setStyleSheet("color: #b3261e;")
        box = QVBoxLayout(self)
        box.addWidget(self.plan_label)
        box.addLayout(buttons)
        box.addLayout(export)
        self.ring = QtRingDiagram()
        self.ring.setMinimumHeight(300)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.table)
        split.addWidget(self.ring)
        self.table.setMinimumHeight(96)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 2)
        split.setChildrenCollapsible(False)
        box.addWidget(split, 1)
        box.addWidget(self.health_label)
        box.addWidget(self.error_label)
        self._update_buttons()
        self._draw_ring()

    def _ask(self, title: str, question: str, detail: str, then) -> None:
        """Ask before anything that drops the chats of the people using the fleet; ``then()`` on Yes."""
        self.confirmation = ask_first(self, title, question, detail, then,
                                      closed=lambda: setattr(self, "confirmation", None))

    def stop(self) -> None:
        """Stop serving, after a question while the ring serves (it cuts off every chat in progress)."""
        if self.serving.phase is not ServingPhase.SERVING:
            self.serving.stop()
            return
        self._ask("Stop serving", "Stop serving the model?",
                  "Every chat in progress is cut off, and the fleet's API answers no one until a model is "
                  "distributed again.", self.serving.stop)

    def distribute(self) -> None:
        if self.session.plan is None:
            return
        if self.serving.phase is ServingPhase.SERVING:
            self._ask("Replace the ring", "Replace the model being served with this plan?",
                      "The running ring stops first: every chat in progress is cut off until the new one is up.",
                      self._distribute)
            return
        self._distribute()

    def _distribute(self) -> None:
        if self.session.plan is None:
            return
        self.rows.clear()
        self.table.setRowCount(0)
        self.error_label.clear()
        self.health_label.setText("Ring: exporting the shards first…")
        self.serving.distribute(self.session.plan)

    # ---- serving -> widgets ----------------------------------------------------------------------

    def _on_export(self, event: ExportEvent) -> None:
        if isinstance(event, ExportProgress):
            self.export_bar.setValue(int(1000 * event.fraction))
            self.export_label.setText(f"Export: {'preparing' if event.stage is None else f'stage {event.stage}'}, "
                                      f"{event.step}")
        elif isinstance(event, ExportFinished):
            self.export_bar.setValue(1000)
            self.export_label.setText(f"Export: {'reused' if event.reused else 'made'} {event.export.export_id}")

    def _on_progress(self, p: AgentProgress) -> None:
        key = (p.agent, p.stage)
        if key not in self.rows:
            self.rows[key] = self.table.rowCount()
            self.table.insertRow(self.table.rowCount())
            made = QProgressBar()
            made.setRange(0, 1000)
            self.table.setCellWidget(self.rows[key], 3, made)
        row = self.rows[key]
        for col, value in ((0, p.agent), (1, str(p.stage)), (2, p.phase), (4, p.error or "")):
            self.table.setItem(row, col, QTableWidgetItem(value))
        bar = self.table.cellWidget(row, 3)
        if isinstance(bar, QProgressBar):  # the row's own, made above
            bar.setValue(int(1000 * p.fraction))
            bar.setFormat(f"%p%  ({p.done_bytes / 1e6:.1f} of {p.total_bytes / 1e6:.1f} MB)")
        self.health_label.setText("Ring: distributing…")

    def _on_health(self, health: RingHealth) -> None:
        where = "stage 0 in the console, " if health.local_stage0 else ""
        self.health_label.setText(f"Ring: healthy — {where}{len(health.agents)} agent stage(s) running; one-token "
                                  f"test in {health.test_ms:.0f} ms. API: {self.serving.api_url}")
        self.error_label.clear()

    def _on_failed(self, message: str) -> None:
        self.health_label.setText("Ring: not running.")
        self.error_label.setText(message)

    def _on_session(self, what: str) -> None:
        if what in (PLAN, SERVING):
            if what == PLAN:
                self._update_buttons()
            self._draw_ring()

    def _on_phase(self, phase: str) -> None:
        if phase in (ServingPhase.EXPORTING, ServingPhase.DISTRIBUTING, ServingPhase.IDLE):
            self.measured.clear()  # a new ring: the last one's measurements are not this one's
        if phase == ServingPhase.IDLE:  # stopped: nothing of the last ring is "running" or "distributing" now
            self.rows.clear()
            self.table.setRowCount(0)
            self.health_label.setText("Ring: not running — nothing is served.")
        self._update_buttons()
        self._draw_ring()

    def _on_metrics(self, metrics: Mapping[str, float]) -> None:
        plan = self._ring_plan()
        if plan is not None:
            self.measured.update(measured_from_metrics(metrics, len(plan.stages)))
            self._draw_ring()

    def _ring_plan(self):
        """The plan drawn: the ring's while one serves (or failed), else the session's."""
        serving = self.session.serving
        shown = (ServingPhase.SERVING, ServingPhase.FAILED, ServingPhase.STOPPING)
        if serving is not None and self.serving.phase in shown:
            return serving.plan
        return self.session.plan

    def _draw_ring(self) -> None:
        plan = self._ring_plan()
        if plan is None:
            self.ring.set_diagram(None, "No plan to draw: place the model on the Placement page first.")
            return
        records = {r.node_id: r for r in self.serving.bridge.records if r.node_id}
        states = {s.pc_id: stage_state(records.get(s.pc_id), self.serving.phase) for s in plan.stages}
        names = {pc: (records[pc].name if pc in records else self.session.name(pc)) for pc in states}
        self.ring.set_diagram(RingDiagram.from_plan(plan, names, states=states, measured_ms=self.measured))

    def _update_buttons(self) -> None:
        phase, plan = self.serving.phase, self.session.plan
        busy = phase in (ServingPhase.EXPORTING, ServingPhase.DISTRIBUTING, ServingPhase.STOPPING)
        if plan is None:
            self.plan_label.setText("No plan: place the model on the Placement page first.")
        else:
            stages = ", ".join(f"{self.session.name(s.pc_id)} layers {s.first_layer}-{s.last_layer}"
                               for s in plan.stages)
            self.plan_label.setText(f"Plan: {len(plan.stages)} stage(s): {stages}. Now: {phase}.")
        self.distribute_button.setEnabled(plan is not None and not busy)
        self.rerun_button.setEnabled(self.serving.can_rerun)
        self.cancel_button.setEnabled(phase == ServingPhase.EXPORTING)
        self.stop_button.setEnabled(phase in (ServingPhase.SERVING, ServingPhase.FAILED))


def stage_state(record: AgentRecord | None, phase: ServingPhase) -> str:
    """What a stage's box says of its agent: "unreachable" when the service's last poll failed, the
    agent's own state while the ring is up or coming up, else "planned"."""
    if record is None:
        return "unreachable" if phase == ServingPhase.SERVING else "planned"
    if record.reachable is False:
        return "unreachable"
    if phase == ServingPhase.IDLE and record.state not in ("paused", "error"):
        return "planned"
    return record.state
