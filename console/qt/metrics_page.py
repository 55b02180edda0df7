"""The Metrics page: the fleet's live tokens per second (a sparkline drawn with QPainter), the
counters that say whether it is healthy (tokens, active streams, failovers, speculation), where a
token's time goes per stage (compute vs network, predicted vs measured), and who paused and why.

Thin: the numbers come from `ServiceServing.metrics` samples and the bridge's hub events; what to
show is decided in :mod:`console.qt.fleet_metrics`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPaintEvent, QPen
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFormLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.qt.fleet_metrics import (
    MetricsHistory,
    PauseLog,
    speculation_text,
    stage_breakdown,
)
from console.qt.service_bridge import ServiceBridge
from console.qt.service_serving import ServiceServing, ServingPhase
from engine.control.hub import AgentEvent

BREAKDOWN_COLUMNS = ("Stage / hop", "Kind", "Predicted ms", "Measured ms")


class QtSparkline(QWidget):
    """A line of the last values from zero up to a little above the largest (so a steady rate is
    not drawn on the frame); the largest and the latest value written at the right."""

    def __init__(self, unit: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.unit = unit
        self.values: list[float] = []
        self.setMinimumHeight(110)

    def set_values(self, values: Sequence[float]) -> None:
        self.values = list(values)
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt's name)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        area = QRectF(self.rect()).adjusted(6, 6, -70, -6)
        painter.fillRect(self.rect(), self.palette().base())
        painter.setPen(QPen(self.palette().mid().color(), 1))
        painter.drawRect(area)
        top = max(self.values, default=0.0)
        painter.setPen(self.palette().text().color())
        painter.drawText(QRectF(area.right() + 6, area.top(), 64, 20), Qt.AlignmentFlag.AlignLeft,
                         f"{top:.1f} max")
        if len(self.values) >= 2 and top > 0:
            step, scale = area.width() / (len(self.values) - 1), area.height() / (1.15 * top)
            path = QPainterPath(QPointF(area.left(), area.bottom() - scale * self.values[0]))
            for i, v in enumerate(self.values[1:], start=1):
                path.lineTo(QPointF(area.left() + i * step, area.bottom() - scale * v))
            painter.setPen(QPen(QColor("#1a73e8"), 2))
            painter.drawPath(path)
        latest = self.values[-1] if self.values else 0.0
        painter.setPen(self.palette().text().color())
        painter.drawText(QRectF(area.right() + 6, area.bottom() - 20, 64, 20), Qt.AlignmentFlag.AlignLeft,
                         f"{latest:.1f} {self.unit}")
        painter.end()


class QtMetricsPage(QWidget):
    def __init__(self, bridge: ServiceBridge, serving: ServiceServing, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.session = bridge.session
        self.history = MetricsHistory()
        self.pauses = PauseLog()
        self._build()
        serving.metrics.connect(self.show_metrics)
        serving.phase_changed.connect(
            lambda phase: self.history.clear() if phase == ServingPhase.DISTRIBUTING else None)
        bridge.hub_event.connect(self._on_hub_event)

    def _build(self) -> None:
        self.sparkline = QtSparkline("tok/s")
        self.tokens = QLabel("0")
        self.rate = QLabel("—")
        self.streams = QLabel("0")
        self.requests = QLabel("0")
        self.failovers = QLabel("0")
        self.speculation = QLabel("off")
        self.ttft = QLabel("—")
        form = QFormLayout()
        for label, widget in (("Tokens per second", self.rate), ("Tokens generated", self.tokens),
                              ("Active streams", self.streams), ("Requests finished", self.requests),
                              ("Time to first token", self.ttft), ("Speculation", self.speculation),
                              ("Failovers", self.failovers)):
            form.addRow(label, widget)
        self.breakdown = QTableWidget(0, len(BREAKDOWN_COLUMNS))
        self.breakdown.setHorizontalHeaderLabels(BREAKDOWN_COLUMNS)
        self.breakdown.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.breakdown.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.breakdown.horizontalHeader().setStretchLastSection(True)
        self.pause_list = QListWidget()
        self.pause_list.setMaximumHeight(120)
        box = QVBoxLayout(self)
        box.addWidget(QLabel("Tokens per second (last two minutes)"))
        box.addWidget(self.sparkline)
        box.addLayout(form)
        box.addWidget(QLabel("Where a token's time goes: each stage's measured compute is the median of its "
                             "latest steps, as the stage reports it"))
        box.addWidget(self.breakdown, 1)
        box.addWidget(QLabel("Pauses reported by agents"))
        box.addWidget(self.pause_list)

    def show_metrics(self, metrics: Mapping[str, float]) -> None:
        self.history.add(metrics)
        self.sparkline.set_values(self.history.series("tokens_per_second"))
        self.rate.setText(f"{metrics.get('tokens_per_second', 0.0):.1f}")
        self.tokens.setText(f"{metrics.get('tokens_generated_total', 0.0):.0f}")
        self.streams.setText(f"{metrics.get('active_streams', 0.0):.0f} of {metrics.get('slots', 0.0):.0f} slots")
        self.requests.setText(f"{metrics.get('requests_finished_total', 0.0):.0f} "
                              f"({metrics.get('requests_failed_total', 0.0):.0f} failed)")
        ttft = metrics.get("ttft_seconds_avg", 0.0)
        self.ttft.setText(f"{1000 * ttft:.0f} ms" if ttft else "—")
        self.speculation.setText(speculation_text(metrics))
        self.failovers.setText(f"{metrics.get('failovers_total', 0.0):.0f}")
        serving = self.session.serving
        rows = stage_breakdown(serving.plan if serving else None, metrics, self.bridge.names(),
                               serving.local_stage0 if serving else False)
        self.breakdown.setRowCount(len(rows))
        for r, row in enumerate(rows):
            measured = "—" if row.measured_ms is None else f"{row.measured_ms:.2f}"
            for c, value in enumerate((row.what, row.kind, f"{row.predicted_ms:.2f}", measured)):
                self.breakdown.setItem(r, c, QTableWidgetItem(value))

    def _on_hub_event(self, event: AgentEvent) -> None:
        entry = self.pauses.take(event, self.bridge.names().get(event.node_id, event.node_id[:12]))
        if entry is not None:
            self.pause_list.addItem(entry.text)
            self.pause_list.scrollToBottom()
