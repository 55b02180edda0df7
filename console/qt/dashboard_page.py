"""The Dashboard page, the console's first tab: the fleet at a glance. The agents by state (a
coloured bar and a count per state), the figures of the moment (models served, requests now,
tokens per second, failovers today), the rings served, and the busiest agents' CPU and memory
over the last minutes as sparklines.

Thin: the bridge's agent records and feed events, and the service's ``GET /admin/v1/metrics``
read every `SAMPLE_S`; what to show is decided in :mod:`console.qt.fleet_overview`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from PySide6.QtCore import QRectF, QSize, Qt, QTimer
from PySide6.QtGui import QColor, QFont, QPainter, QPaintEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.feed import Event, EventKind
from console.qt.fleet_overview import (
    HISTORY_S,
    SAMPLE_S,
    Figures,
    LoadHistory,
    StateCount,
    dashboard_state,
    figures,
    members,
    ring_lines,
    state_counts,
)
from console.qt.service_bridge import ServiceBridge
from console.qt.sparkline import QtSparkline

log = logging.getLogger("deskfleet.console")

BUSIEST = 12  # agents with sparklines (of a fleet of any size)
RING_COLUMNS = ("Ring", "Model", "Phase", "Stages", "Tokens/s", "Streams")
LOAD_COLUMNS = ("Agent", "State", f"CPU (last {HISTORY_S / 60:.0f} min)",
                f"Memory used (last {HISTORY_S / 60:.0f} min)", "Memory now")
GB = 1 << 30


class QtStateBar(QWidget):
    """The members by state: one bar split in proportion, a coloured chip and count per state."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.counts: tuple[StateCount, ...] = ()
        self.setMinimumHeight(64)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return QSize(600, 64)

    def set_counts(self, counts: Sequence[StateCount]) -> None:
        self.counts = tuple(counts)
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt's name)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        bar = QRectF(0, 2, self.width(), 24)
        total = sum(c.count for c in self.counts)
        if total == 0:
            painter.fillRect(bar, self.palette().midlight())
            painter.setPen(self.palette().text().color())
            painter.drawText(bar, Qt.AlignmentFlag.AlignCenter, "no agents in this fleet yet")
        x = 0.0
        for c in self.counts:
            w = bar.width() * c.count / total
            painter.fillRect(QRectF(x, bar.top(), w, bar.height()), QColor(c.colour))
            x += w
        x = 0.0
        legend_y = bar.bottom() + 10
        bold = QFont(self.font())
        bold.setBold(True)
        for c in self.counts:
            painter.fillRect(QRectF(x, legend_y + 4, 12, 12), QColor(c.colour))
            text = f"{c.state} {c.count}"
            painter.setFont(bold)
            painter.setPen(self.palette().text().color())
            width = painter.fontMetrics().horizontalAdvance(text)
            painter.drawText(QRectF(x + 16, legend_y, width + 4, 20), Qt.AlignmentFlag.AlignVCenter, text)
            x += width + 36
        painter.end()


class QtFigure(QFrame):
    """A tile: a big number with its caption and a line under it."""

    def __init__(self, caption: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.value = QLabel("—")
        big = QFont(self.font())
        big.setPointSizeF(self.font().pointSizeF() * 2.2)
        big.setBold(True)
        self.value.setFont(big)
        self.caption = QLabel(caption)
        self.detail = QLabel("")
        self.detail.setWordWrap(True)
        self.detail.setStyleSheet("color: #5f6368;")
        box = QVBoxLayout(self)
        box.addWidget(self.caption)
        box.addWidget(self.value)
        box.addWidget(self.detail)

    def show_value(self, value: str, detail: str = "") -> None:
        self.value.setText(value)
        self.detail.setText(detail)


def _table(columns: Sequence[str]) -> QTableWidget:
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(columns)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
    table.verticalHeader().setVisible(False)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    return table


class QtDashboardPage(QWidget):
    def __init__(self, bridge: ServiceBridge, parent: QWidget | None = None, *, sample_s: float = SAMPLE_S) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.history = LoadHistory(sample_s=sample_s)
        self.rings: dict[str, dict[str, Any]] = {}  # ring id -> its JSON from the feed
        self.metrics: dict[str, Mapping[str, float]] = {}  # ring id -> its coordinator's metrics
        self.failovers_today: int | None = None
        self.figures: Figures | None = None
        self._reading = False  # a metrics read is on its way
        self._build()
        bridge.records_changed.connect(self._on_records)
        bridge.service_event.connect(self._on_event)
        self._timer = QTimer(self)
        self._timer.setInterval(int(sample_s * 1000))
        self._timer.timeout.connect(self.sample)
        bridge.started.connect(self._timer.start)
        bridge.started.connect(self.sample)
        if bridge.running:  # made after the bridge started (a test's own page)
            self._timer.start()
        self._on_records(bridge.records)

    def _build(self) -> None:
        self.agents_title = QLabel("Agents")
        self.state_bar = QtStateBar()
        self.models_tile = QtFigure("Models served")
        self.requests_tile = QtFigure("Requests now")
        self.rate_tile = QtFigure("Tokens per second")
        self.failovers_tile = QtFigure("Failovers today")
        tiles = QGridLayout()
        for i, tile in enumerate((self.models_tile, self.requests_tile, self.rate_tile, self.failovers_tile)):
            tiles.addWidget(tile, 0, i)
        self.rings_table = _table(RING_COLUMNS)
        self.rings_table.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.rings_table.setMaximumHeight(120)
        self.load_title = QLabel(f"Busiest agents (CPU and memory over the last {HISTORY_S / 60:.0f} minutes)")
        self.load_table = _table(LOAD_COLUMNS)
        header = self.load_table.horizontalHeader()
        for column in (2, 3):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.Stretch)
        box = self.column = QVBoxLayout(self)
        top = QHBoxLayout()
        top.addWidget(self.agents_title)
        top.addStretch(1)
        box.addLayout(top)
        box.addWidget(self.state_bar)
        box.addLayout(tiles)
        box.addWidget(QLabel("Rings"))
        box.addWidget(self.rings_table)
        box.addWidget(self.load_title)
        box.addWidget(self.load_table, 1)
        self._show_figures()

    def add_first_steps(self, checklist: QWidget) -> None:
        """Put the "Get started" checklist at the top of the page (it hides itself once done)."""
        self.column.insertWidget(0, checklist)

    def set_sample_s(self, seconds: float) -> None:
        """Sample the agents' load and the service's metrics every ``seconds`` from now on."""
        self.history.sample_s = seconds
        self._timer.setInterval(int(seconds * 1000))

    # ---- sources ---------------------------------------------------------------------------------

    def _on_records(self, records: tuple[AgentRecord, ...]) -> None:
        counts = state_counts(records)
        self.state_bar.set_counts(counts)
        total = sum(c.count for c in counts)
        self.agents_title.setText(f"Agents: {total} in this fleet")

    def _on_event(self, event: Event) -> None:
        if event.kind is EventKind.RING:
            ring = event.data.get("ring") or {}
            if isinstance(ring, dict) and ring.get("ring"):
                self.rings[str(ring["ring"])] = ring
                self._show_figures()
        elif event.kind is EventKind.RING_REMOVED:
            self.rings.pop(str(event.data.get("ring")), None)
            self.metrics.pop(str(event.data.get("ring")), None)
            self._show_figures()
        elif event.kind is EventKind.METRICS:
            self._take_metrics(event.data)

    def sample(self) -> None:
        """Every `SAMPLE_S`: the agents' load into the history, and the service's metrics read."""
        self.history.add(self.bridge.records, time.monotonic())
        self._show_load()
        if self._reading or not self.bridge.running:
            return
        self._reading = True

        def took(data: dict[str, Any]) -> None:
            self._reading = False
            self._take_metrics(data)

        def failed(exc: BaseException) -> None:
            self._reading = False
            log.debug("reading the service's metrics for the dashboard: %s", exc)

        self.bridge.call(self.bridge.client.async_call("GET", "/metrics"), "reading the fleet's metrics",
                         on_result=took, on_error=failed)

    def _take_metrics(self, data: Mapping[str, Any]) -> None:
        rings = data.get("rings")
        if isinstance(rings, dict):
            self.metrics = {str(k): v for k, v in rings.items() if isinstance(v, dict)}
        today = data.get("failovers_today")
        if isinstance(today, int):
            self.failovers_today = today
        self._show_figures()

    # ---- widgets ---------------------------------------------------------------------------------

    def _show_figures(self) -> None:
        lines = ring_lines(self.rings, self.metrics)
        f = self.figures = figures(lines, self.failovers_today)
        self.models_tile.show_value(str(len(f.models)), ", ".join(f.models) or "no ring serving")
        self.requests_tile.show_value("—" if f.requests_now is None else str(f.requests_now),
                                      f"over {f.rings_serving} ring(s) serving")
        self.rate_tile.show_value("—" if f.tok_s is None else f"{f.tok_s:.1f}", "generated, all rings")
        self.failovers_tile.show_value("—" if f.failovers_today is None else str(f.failovers_today),
                                       "stages moved or reconnected since midnight")
        self.rings_table.setRowCount(len(lines))
        for r, line in enumerate(lines):
            cells = (line.ring, line.model, line.phase, str(line.stages),
                     "—" if line.tok_s is None else f"{line.tok_s:.1f}",
                     "—" if line.active_streams is None else str(line.active_streams))
            for c, text in enumerate(cells):
                self.rings_table.setItem(r, c, QTableWidgetItem(text))

    def _show_load(self) -> None:
        records = {r.key: r for r in members(self.bridge.records)}
        keys = [k for k in self.history.busiest(BUSIEST) if k in records]
        shown = len(records)
        self.load_title.setText(f"Busiest agents (CPU and memory over the last {HISTORY_S / 60:.0f} minutes)"
                                + (f": {len(keys)} of {shown}" if shown > len(keys) else ""))
        table = self.load_table
        table.setRowCount(len(keys))
        for row, key in enumerate(keys):
            record = records[key]
            cpu, mem = table.cellWidget(row, 2), table.cellWidget(row, 3)
            if not (isinstance(cpu, QtSparkline) and isinstance(mem, QtSparkline)):
                cpu, mem = QtSparkline(100.0, "#1a73e8"), QtSparkline(1.0, "#a142f4", lambda v: f"{100 * v:.0f} %")
                table.setCellWidget(row, 2, cpu)
                table.setCellWidget(row, 3, mem)
            cpu.set_values(self.history.cpu(key))
            mem.set_values(self.history.memory(key))
            used = record.status.memory_used_bytes if record.status is not None else None
            total = record.status.inventory.get("ram_total") if record.status is not None else None
            memory = (f"{used / GB:.1f} of {total / GB:.1f} GB" if isinstance(used, int) and isinstance(total, int)
                      else "—")
            cells = {0: record.name, 1: dashboard_state(record), 4: memory}
            for column, text in cells.items():
                table.setItem(row, column, QTableWidgetItem(text))
            table.setRowHeight(row, 30)
