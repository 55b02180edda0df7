"""A placement drawn as a ring: the coordinator and every stage a box around a circle (each PC
with its device, layers and per-token ms, predicted and — when the ring runs — measured), each
hop an arrow with its round-trip time, and the slowest stage or hop highlighted.

Two halves, as the rest of the console: `RingDiagram` is a pure frozen model built from a
`Plan` (plus agent names, agent states and live measured per-stage ms when known) that decides
what is drawn, including which element is the bottleneck; `QtRingDiagram` only paints one.
The Placement page shows the solved plan; the Distribution page the running ring, live.

Hop times: a plan's ``hop_ms`` are one-way latencies (half the link probe's median round trip,
see :mod:`console.fleet.links`); the diagram labels each hop with its round trip (twice
that) because that is what an admin can check with ping, and compares the one-way time — what
a token actually spends on the hop — with the stages' ms to find the bottleneck.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPainterPath, QPaintEvent, QPen, QPolygonF
from PySide6.QtWidgets import QSizePolicy, QWidget

from engine.placement.types import Plan

STAGE_COMPUTE = 'stage_compute_ms_per_step{{stage="{k}"}}'  # the coordinator's measured ms per stage
PLANNED = "planned"  # a stage of a plan not brought up (the Placement page)
COMPACT_OVER = 8  # stages beyond which the boxes shrink to two lines


@dataclass(frozen=True)
class RingStage:
    """One stage box: ``name`` is the agent's name, ``device`` its OpenVINO device ("GPU")."""

    name: str
    device: str
    first_layer: int
    last_layer: int
    predicted_ms: float
    measured_ms: float | None = None
    state: str = PLANNED

    @property
    def ms(self) -> float:
        """The stage's time per token as the diagram weighs it: measured when known."""
        return self.predicted_ms if self.measured_ms is None else self.measured_ms

    @property
    def layers(self) -> str:
        return f"layers {self.first_layer}–{self.last_layer}"


@dataclass(frozen=True)
class RingHop:
    """The arrow from node ``k`` to node ``k + 1`` of the ring (node 0: the coordinator)."""

    one_way_ms: float

    @property
    def rtt_ms(self) -> float:
        return 2.0 * self.one_way_ms


@dataclass(frozen=True)
class Bottleneck:
    """The slowest element: ``kind`` "stage" or "hop", its index in `RingDiagram.stages` or
    `RingDiagram.hops`, and the ms a token spends there."""

    kind: str
    index: int
    ms: float


@dataclass(frozen=True)
class RingDiagram:
    """What the ring picture shows. ``hops`` has one entry more than ``stages``: coordinator →
    stage 0, stage k → k+1, last stage → coordinator (as `Plan.hop_ms`)."""

    stages: tuple[RingStage, ...]
    hops: tuple[RingHop, ...]
    coordinator: str = "console"
    per_token_ms: float = 0.0
    tok_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a ring diagram needs at least one stage")
        if len(self.hops) != len(self.stages) + 1:
            raise ValueError(f"a ring of {len(self.stages)} stage(s) has {len(self.stages) + 1} hops, "
                             f"not {len(self.hops)}")

    @classmethod
    def from_plan(cls, plan: Plan, names: Mapping[str, str] | None = None, *,
                  states: Mapping[str, str] | None = None, measured_ms: Mapping[int, float] | None = None,
                  coordinator: str = "console") -> RingDiagram:
        """The diagram of ``plan``: agents named by ``names`` (node id → name; else the id's start),
        each stage's ``states`` by node id (else "planned"), ``measured_ms`` by stage index."""
        names, states, measured = names or {}, states or {}, measured_ms or {}
        stages = tuple(RingStage(name=names.get(s.pc_id) or s.pc_id[:12], device=s.device_id.rsplit("/", 1)[-1],
                                 first_layer=s.first_layer, last_layer=s.last_layer, predicted_ms=s.compute_ms,
                                 measured_ms=measured.get(k), state=states.get(s.pc_id, PLANNED))
                       for k, s in enumerate(plan.stages))
        return cls(stages, tuple(RingHop(ms) for ms in plan.hop_ms), coordinator, plan.per_token_ms, plan.tok_s)

    def with_live(self, *, measured_ms: Mapping[int, float] | None = None,
                  states: Mapping[int, str] | None = None) -> RingDiagram:
        """The same ring with new measured ms and states, both by stage index (others kept)."""
        measured, states = measured_ms or {}, states or {}
        return replace(self, stages=tuple(
            replace(s, measured_ms=measured.get(k, s.measured_ms), state=states.get(k, s.state))
            for k, s in enumerate(self.stages)))

    @property
    def bottleneck(self) -> Bottleneck:
        """The slowest stage (measured ms where known) or hop (one way); a stage wins a tie."""
        best = max(range(len(self.stages)), key=lambda k: self.stages[k].ms)
        worst = Bottleneck("stage", best, self.stages[best].ms)
        for k, hop in enumerate(self.hops):
            if hop.one_way_ms > worst.ms:
                worst = Bottleneck("hop", k, hop.one_way_ms)
        return worst

    @property
    def measured(self) -> bool:
        return any(s.measured_ms is not None for s in self.stages)

    def node_names(self) -> tuple[str, ...]:
        """The ring's nodes in order: the coordinator, then every stage's agent."""
        return (self.coordinator, *(s.name for s in self.stages))

    def hop_text(self, k: int) -> str:
        return f"RTT {self.hops[k].rtt_ms:.2f} ms"

    def stage_lines(self, k: int, *, compact: bool = False) -> tuple[str, ...]:
        """The text of stage ``k``'s box, most important first (a small box shows the first lines)."""
        s = self.stages[k]
        if compact:
            return (f"{s.name} · {s.device}", f"{s.ms:.1f} ms{'' if s.measured_ms is None else ' meas.'}"
                                              f" · {s.first_layer}–{s.last_layer}")
        times = f"{s.predicted_ms:.2f} ms predicted"
        lines: tuple[str, ...] = (f"{s.name} · {s.device}", f"{s.layers}  ({s.last_layer - s.first_layer + 1})", times)
        if s.measured_ms is not None:
            lines += (f"{s.measured_ms:.2f} ms measured",)
        return lines

    def summary(self) -> str:
        """One line under the picture: the ring's prediction and its bottleneck."""
        b = self.bottleneck
        names = self.node_names()
        if b.kind == "stage":
            where = f"stage {b.index} on {self.stages[b.index].name}"
        else:
            where = f"hop {names[b.index]} → {names[(b.index + 1) % len(names)]}"
        if b.kind == "hop":
            basis = "link probe"
        else:
            basis = "measured" if self.stages[b.index].measured_ms is not None else "predicted"
        return (f"{len(self.stages)} stage(s), {self.per_token_ms:.2f} ms per token predicted "
                f"({self.tok_s:.1f} tok/s for one stream); bottleneck ({basis}): {where}, {b.ms:.2f} ms")


def measured_from_metrics(metrics: Mapping[str, float], n_stages: int) -> dict[int, float]:
    """The coordinator's measured compute ms per stage from a metrics sample (stages it does not
    report are left out)."""
    out = {}
    for k in range(n_stages):
        value = metrics.get(STAGE_COMPUTE.format(k=k))
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            out[k] = float(value)
    return out


# ---- the view ------------------------------------------------------------------------------------

STATE_COLOURS = {  # the strip on top of a stage box
    PLANNED: "#9aa0a6", "serving": "#1e8e3e", "idle": "#5f6368", "fetching": "#1a73e8",
    "paused": "#f9ab00", "error": "#d93025", "unreachable": "#d93025", "failed": "#d93025",
}
BOTTLENECK = QColor("#d93025")
BOX_FILL = QColor("#ffffff")
BOTTLENECK_FILL = QColor("#fce8e6")
COORDINATOR_FILL = QColor("#e8f0fe")
ARROW = QColor("#5f6368")


class QtRingDiagram(QWidget):
    """Paints a `RingDiagram` (or a line of text when there is none): boxes evenly around an
    ellipse starting at the top with the coordinator, arrows clockwise with each hop's RTT, the
    bottleneck box or arrow in red, and the summary along the bottom."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.diagram: RingDiagram | None = None
        self.empty_text = "No plan."
        self.setMinimumSize(360, 260)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return QSize(640, 420)

    def set_diagram(self, diagram: RingDiagram | None, empty_text: str | None = None) -> None:
        self.diagram = diagram
        if empty_text is not None:
            self.empty_text = empty_text
        self.update()

    @property
    def compact(self) -> bool:
        """Many stages: two lines a box and only the bottleneck hop labelled."""
        return self.diagram is not None and len(self.diagram.stages) > COMPACT_OVER

    def layout_nodes(self) -> tuple[list[QPointF], float, float]:
        """The centre of every node (coordinator first, clockwise from the top, evenly spaced
        along the ellipse so no side crowds) and the boxes' width and height."""
        n = 1 + (len(self.diagram.stages) if self.diagram is not None else 0)
        area = QRectF(self.rect()).adjusted(8, 8, -8, -30)
        box_h = 40.0 if self.compact else min(84.0 if n <= 7 else 66.0, max(56.0, area.height() / 3.5))
        rx0, ry0 = area.width() / 2, area.height() / 2
        perimeter = math.pi * (3 * (rx0 + ry0) - math.sqrt((3 * rx0 + ry0) * (rx0 + 3 * ry0)))  # Ramanujan
        box_w = min(190.0, max(60.0 if self.compact else 110.0, (0.8 if self.compact else 0.6) * perimeter / n))
        rx, ry = max(rx0 - box_w / 2, 10.0), max(ry0 - box_h / 2, 10.0)
        samples = 720
        points = [(math.sin(2 * math.pi * i / samples), -math.cos(2 * math.pi * i / samples)) for i in range(samples)]
        lengths = [0.0]
        for (x0, y0), (x1, y1) in zip(points, points[1:] + points[:1], strict=True):
            lengths.append(lengths[-1] + math.hypot(rx * (x1 - x0), ry * (y1 - y0)))
        c, centres, j = area.center(), [], 0
        for i in range(n):
            target = lengths[-1] * i / n
            while lengths[j + 1] < target:
                j += 1
            x, y = points[j]
            centres.append(QPointF(c.x() + rx * x, c.y() + ry * y))
        return centres, box_w, box_h

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt's name)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), self.palette().base())
        d = self.diagram
        if d is None:
            painter.setPen(self.palette().placeholderText().color())
            painter.drawText(QRectF(self.rect()), Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap,
                             self.empty_text)
            painter.end()
            return
        centres, w, h = self.layout_nodes()
        centre = QRectF(self.rect()).adjusted(8, 8, -8, -30).center()
        rects = [QRectF(p.x() - w / 2, p.y() - h / 2, w, h) for p in centres]
        bottleneck = d.bottleneck
        small = QFont(self.font())
        small.setPointSizeF(max(6.5, self.font().pointSizeF() * (0.9 if len(rects) <= 8 else 0.78)))
        for k in range(len(d.hops)):
            hot = bottleneck.kind == "hop" and bottleneck.index == k
            label = d.hop_text(k) if hot or not self.compact else ""
            self._arrow(painter, rects[k], rects[(k + 1) % len(rects)], label, hot, small, centre)
        self._box(painter, rects[0], (d.coordinator, "coordinator"), None, COORDINATOR_FILL, False, small)
        for k, stage in enumerate(d.stages):
            hot = bottleneck.kind == "stage" and bottleneck.index == k
            strip = STATE_COLOURS.get(stage.state, STATE_COLOURS[PLANNED])
            self._box(painter, rects[k + 1], d.stage_lines(k, compact=self.compact), strip,
                      BOTTLENECK_FILL if hot else BOX_FILL, hot, small)
        painter.setFont(self.font())
        painter.setPen(self.palette().text().color())
        summary = painter.fontMetrics().elidedText(d.summary(), Qt.TextElideMode.ElideRight, self.width() - 16)
        painter.drawText(QRectF(8, self.height() - 26, self.width() - 16, 22),
                         Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, summary)
        painter.end()

    def _box(self, painter: QPainter, rect: QRectF, lines: tuple[str, ...], strip: str | None, fill: QColor,
             hot: bool, font: QFont) -> None:
        path = QPainterPath()
        path.addRoundedRect(rect, 6, 6)
        painter.fillPath(path, fill)
        painter.setPen(QPen(BOTTLENECK if hot else QColor("#80868b"), 3 if hot else 1))
        painter.drawPath(path)
        if strip is not None:
            painter.fillRect(QRectF(rect.left() + 4, rect.top() + 2, rect.width() - 8, 4), QColor(strip))
        painter.setFont(font)
        line_h = painter.fontMetrics().height()
        fits = max(1, int((rect.height() - 10) // line_h))
        shown = list(lines[:fits])
        if hot and len(lines) <= fits - 1:
            shown.append("bottleneck")
        y = rect.top() + 8
        for i, text in enumerate(shown):
            bold = i == 0 or (hot and text == "bottleneck")
            f = QFont(font)
            f.setBold(bold)
            painter.setFont(f)
            painter.setPen(BOTTLENECK if hot and text == "bottleneck" else QColor("#202124"))
            elided = painter.fontMetrics().elidedText(text, Qt.TextElideMode.ElideRight, int(rect.width() - 10))
            painter.drawText(QRectF(rect.left() + 5, y, rect.width() - 10, line_h), Qt.AlignmentFlag.AlignHCenter,
                             elided)
            y += line_h

    def _arrow(self, painter: QPainter, a: QRectF, b: QRectF, label: str, hot: bool, font: QFont,
               centre: QPointF) -> None:
        start, end = _edge_point(a, b.center()), _edge_point(b, a.center())
        colour = BOTTLENECK if hot else ARROW
        painter.setPen(QPen(colour, 3 if hot else 1.5))
        painter.drawLine(start, end)
        angle = math.atan2(end.y() - start.y(), end.x() - start.x())
        head = QPolygonF([end, QPointF(end.x() - 10 * math.cos(angle - 0.4), end.y() - 10 * math.sin(angle - 0.4)),
                          QPointF(end.x() - 10 * math.cos(angle + 0.4), end.y() - 10 * math.sin(angle + 0.4))])
        painter.setBrush(colour)
        painter.drawPolygon(head)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        if not label:
            return
        painter.setFont(font)
        metrics = painter.fontMetrics()
        width, height = metrics.horizontalAdvance(label) + 8, metrics.height() + 2
        mid = QPointF((start.x() + end.x()) / 2, (start.y() + end.y()) / 2)
        if math.hypot(end.x() - start.x(), end.y() - start.y()) < width + 16:  # a short arrow: label inside the ring
            dx, dy = centre.x() - mid.x(), centre.y() - mid.y()
            norm = math.hypot(dx, dy) or 1.0
            mid = QPointF(mid.x() + dx / norm * (height + 6), mid.y() + dy / norm * (height + 6))
        box = QRectF(mid.x() - width / 2, mid.y() - height / 2, width, height)
        painter.fillRect(box, self.palette().base())
        painter.setPen(colour)
        painter.drawText(box, Qt.AlignmentFlag.AlignCenter, label)


def _edge_point(rect: QRectF, toward: QPointF) -> QPointF:
    """Where the line from ``rect``'s centre to ``toward`` leaves the rectangle."""
    c = rect.center()
    dx, dy = toward.x() - c.x(), toward.y() - c.y()
    if dx == 0 and dy == 0:
        return c
    scale = min(rect.width() / 2 / abs(dx) if dx else math.inf, rect.height() / 2 / abs(dy) if dy else math.inf)
    return QPointF(c.x() + dx * scale, c.y() + dy * scale)
