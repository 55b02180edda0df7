"""A small sparkline: the last values as a filled line on a fixed scale (0 to ``ceiling``), so
two agents' lines compare at a glance, with the latest value written at the right. The
Dashboard draws one per agent for CPU and one for memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget


def percent(value: float) -> str:
    return f"{value:.0f} %"


class QtSparkline(QWidget):
    """``set_values(values)`` (oldest first) on a scale of 0..``ceiling``; ``label(latest)``
    writes the latest value (nothing is written while there are no values)."""

    def __init__(self, ceiling: float = 100.0, colour: str = "#1a73e8", label: Callable[[float], str] = percent,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.ceiling = ceiling
        self.colour = QColor(colour)
        self.label = label
        self.values: list[float] = []
        self.setMinimumSize(120, 22)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return QSize(180, 26)

    def set_values(self, values: Sequence[float]) -> None:
        self.values = [min(max(v, 0.0), self.ceiling) for v in values]
        self.update()

    def line_area(self) -> QRectF:
        """Where the line is drawn (the text of the latest value is to its right)."""
        return QRectF(self.rect()).adjusted(2, 3, -50, -3)

    def points(self) -> list[QPointF]:
        area = self.line_area()
        if not self.values:
            return []
        step = area.width() / max(len(self.values) - 1, 1)
        scale = area.height() / self.ceiling if self.ceiling > 0 else 0.0
        return [QPointF(area.left() + i * step, area.bottom() - scale * v) for i, v in enumerate(self.values)]

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt's name)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        area = self.line_area()
        painter.setPen(QPen(self.palette().mid().color(), 1))
        painter.drawLine(area.bottomLeft(), area.bottomRight())
        points = self.points()
        if len(points) >= 2:
            fill = QPainterPath(QPointF(points[0].x(), area.bottom()))
            for p in points:
                fill.lineTo(p)
            fill.lineTo(QPointF(points[-1].x(), area.bottom()))
            fill.closeSubpath()
            soft = QColor(self.colour)
            soft.setAlpha(60)
            painter.fillPath(fill, soft)
            line = QPainterPath(points[0])
            for p in points[1:]:
                line.lineTo(p)
            painter.setPen(QPen(self.colour, 1.6))
            painter.drawPath(line)
        elif points:
            painter.setPen(QPen(self.colour, 3))
            painter.drawPoint(points[0])
        if self.values:
            painter.setPen(self.palette().text().color())
            painter.drawText(QRectF(area.right() + 4, 0, 46, self.height()),
                             Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, self.label(self.values[-1]))
        painter.end()
