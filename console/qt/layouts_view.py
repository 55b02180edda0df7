"""The Placement page's layouts: copies or rings, for the users expected.

Each alternative the fleet's PCs allow (`engine.placement.layouts.propose`: every PC its own copy of
the model, rings of several PCs, or a mix) with its predicted aggregate tok/s at one user and at the
users expected, best first, the proposed one marked; a model no arrangement holds shows why (the
memory it needs, the memory the PCs have). The users expected are the admin's (the spin box), or,
left at "auto", the most seen at once in the coordinators' metrics since the console started.
A thin view: the choice is pure and made on every change.
"""

from __future__ import annotations

from collections.abc import Mapping

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.placement import PlacementInputs
from engine.placement.layouts import Layout, LayoutChoice, LayoutKind, expected_users, propose, users_in_load

AUTO = 0  # the users spin box's "auto": from the load seen
WHY = {"copies": "every PC holds the whole model", "rings": "the model is split over PCs",
       "mixed": "copies where a PC holds the model, rings of the others"}


def columns(users: int) -> tuple[str, ...]:
    return ("", "Layout", "Kind", "PCs", "tok/s, 1 user", f"tok/s, {users} users")


class QtLayoutsView(QWidget):
    """The alternatives for the session's placement inputs (``show_inputs``) and the load seen (``take_metrics``)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.inputs: PlacementInputs | None = None
        self.headroom = 0.8
        self.peak_users = 0
        self.choice: LayoutChoice | None = None
        self.users = QSpinBox()
        self.users.setRange(AUTO, 4096)
        self.users.setSpecialValueText("auto")
        self.users.setToolTip("the users you expect at once; auto: the most seen at once, or "
                              "8 before any load is seen")
        self.users.valueChanged.connect(lambda _: self.refresh())
        self.source = QLabel()
        self.source.setStyleSheet("color: #5f6368;")
        self.table = QTableWidget(0, len(columns(1)))
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.setMaximumHeight(150)
        self.verdict = QLabel("Place the model to see how your PCs could serve it: copies, rings or both.")
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row = QHBoxLayout()
        row.addWidget(QLabel("<b>Copies or rings?</b> Users expected at once:"))
        row.addWidget(self.users)
        row.addWidget(self.source, 1)
        box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.addLayout(row)
        box.addWidget(self.table)
        box.addWidget(self.verdict)

    def show_inputs(self, inputs: PlacementInputs | None, headroom: float = 0.8) -> None:
        self.inputs, self.headroom = inputs, headroom
        self.refresh()

    def take_metrics(self, rings: Mapping[str, Mapping[str, float]]) -> None:
        """A metrics event's rings: the most users seen at once (refreshes when it grows, under auto)."""
        seen = users_in_load(rings)
        if seen > self.peak_users:
            self.peak_users = seen
            if self.users.value() == AUTO:
                self.refresh()

    def refresh(self) -> None:
        setting = self.users.value()
        users, source = expected_users(None if setting == AUTO else setting, self.peak_users or None)
        self.source.setText(source)
        inputs = self.inputs
        self.choice = None if inputs is None else propose(
            inputs.model, inputs.pcs, inputs.devices, inputs.links.links, users=users, users_source=source,
            names=inputs.names, headroom=self.headroom)
        self._show(users)

    def _show(self, users: int) -> None:
        choice = self.choice
        self.table.setHorizontalHeaderLabels(columns(users))
        layouts = choice.alternatives if choice is not None else ()
        self.table.setRowCount(len(layouts))
        for k, layout in enumerate(layouts):
            values = ("proposed" if k == 0 else "", layout.name, str(layout.kind), self._pcs(layout),
                      f"{layout.tok_s_one:.1f}", f"{layout.tok_s_users:.1f}")
            for col, value in enumerate(values):
                item = QTableWidgetItem(value)
                if k == 0:
                    font = item.font()
                    font.setBold(True)
                    item.setFont(font)
                self.table.setItem(k, col, item)
        self.verdict.setStyleSheet("" if choice is None or choice.chosen is not None else "color: #b3261e;")
        self.verdict.setText(self._verdict(choice, users))

    def _pcs(self, layout: Layout) -> str:
        name = self.inputs.name if self.inputs is not None else (lambda pc: pc[:12])
        rings = ["+".join(name(pc) for pc in ring.pcs) for ring in layout.rings]
        return ", ".join(rings) + (f"  (unused: {', '.join(name(pc) for pc in layout.unused)})"
                                   if layout.unused else "")

    @staticmethod
    def _verdict(choice: LayoutChoice | None, users: int) -> str:
        if choice is None:
            return "Place the model to see how your PCs could serve it: copies, rings or both."
        best = choice.chosen
        if best is None:
            return f"No layout holds this model: {choice.refused}."
        text = (f"Proposed for {users} users: {best.name} ({WHY[str(best.kind)]}), predicted "
                f"{best.tok_s_users:.1f} tok/s in all, {best.tok_s_one:.1f} tok/s for one user alone.")
        others = [b for kind in LayoutKind if kind is not best.kind and (b := choice.best_of(kind)) is not None]
        text += "".join(f" The best {b.kind} layout ({b.name}) would serve {b.tok_s_users:.1f}." for b in others)
        return text
