"""The Placement page: place the chosen model over the approved agents, see the plan per stage
(agent, layers, predicted ms, memory), drawn as a ring (console.qt.ring_diagram), and its predicted
speed, or the solver's explanation when no plan exists; then adjust it: move a split point and
see the plan re-timed at once, or leave an agent out and re-solve (no measuring again).

Under the plan, the layouts the PCs allow (console.qt.layouts_view): every PC its own copy, rings,
or both, each with its predicted tok/s at one user and at the users expected, the best proposed.

For a mixture-of-experts model a line under the plan says what its numbers mean: memory counts
every expert, each step reads only the active ones (`console.fleet_api.placement.moe_note`).

The context is left to the service by default ("auto"): the model's maximum, capped by what the
agents' memory holds, with the reason shown beside the field. Placement can keep to agents with
some tags and avoid others (the agents' tags: their own, or the admin's from the service).

A thin view over the console session's plan: the measuring, calibration and solving run in the
fleet service through the bridge; re-timing is pure (`console.fleet_api.placement.retime`).
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.feed import Event, EventKind
from console.fleet_api.placement import memory_warnings, moe_note, retime, stage_firsts
from console.qt.layouts_view import QtLayoutsView
from console.qt.ring_diagram import QtRingDiagram, RingDiagram
from console.qt.service_bridge import ServiceBridge
from console.qt.session import MODEL, PLAN
from engine.control.tags import tags_from_text
from engine.errors import DeskfleetError
from engine.placement.planner import plan_quality
from engine.placement.types import Objective, PlacementRequest, Plan

COLUMNS = ("Stage", "Agent", "Device", "Layers", "Predicted ms", "Memory", "Hop to next ms")
AUTO = 0  # the context spin box's "auto": the service chooses (model maximum, capped by memory)
AUTO_HINT = "auto: the model's maximum, capped by what the agents' memory holds"


def fleet_tags_text(records: tuple[AgentRecord, ...]) -> str:
    """'Tags in the fleet: finance (2), floor-2 (3)' over the approved agents."""
    counts: dict[str, int] = {}
    for r in records:
        if r.approved:
            for t in r.tags:
                counts[t] = counts.get(t, 0) + 1
    if not counts:
        return "No approved agent has tags yet (deskfleet agent --tags, or deskfleet fleet tag)."
    return "Tags in the fleet: " + ", ".join(f"{t} ({n})" for t, n in sorted(counts.items()))


class QtPlacementPage(QWidget):
    def __init__(self, bridge: ServiceBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.session = bridge.session
        self.busy = False
        self.split_boxes: list[QSpinBox] = []
        self._build()
        self.session.subscribe(self._on_session)
        bridge.started.connect(self._update_buttons)
        bridge.records_changed.connect(self._on_records)
        bridge.service_event.connect(self._on_event)
        self._on_session(MODEL)
        self._on_records(bridge.records)

    def _build(self) -> None:
        self.model_label = QLabel()
        self.objective = QComboBox()
        self.objective.addItems(["latency", "throughput"])
        self.streams = QSpinBox()
        self.streams.setRange(1, 64)
        self.context = QSpinBox()
        self.context.setRange(AUTO, 2**31 - 1)  # huge contexts: what-if for memory
        self.context.setSpecialValueText("auto")
        self.context.setSingleStep(1024)
        self.context.setValue(AUTO)
        self.context.setToolTip(AUTO_HINT + "; or a number of tokens")
        self.context_reason = QLabel(AUTO_HINT)
        self.context_reason.setWordWrap(True)
        self.context_reason.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.place_button = QPushButton("Place")
        self.place_button.clicked.connect(self.place)
        controls = QHBoxLayout()
        for label, widget in (("Objective:", self.objective), ("Streams:", self.streams),
                              ("Context:", self.context)):
            controls.addWidget(QLabel(label))
            controls.addWidget(widget)
        controls.addWidget(self.place_button)
        controls.addWidget(self.context_reason, 1)

        self.include_tags = QLineEdit()
        self.include_tags.setPlaceholderText("any agent (e.g. floor-2, finance)")
        self.include_tags.setToolTip("only agents carrying at least one of these tags (comma-separated)")
        self.exclude_tags = QLineEdit()
        self.exclude_tags.setPlaceholderText("none")
        self.exclude_tags.setToolTip("never agents carrying any of these tags (comma-separated); this wins")
        self.fleet_tags = QLabel(fleet_tags_text(()))
        self.fleet_tags.setStyleSheet("color: #5f6368;")
        tag_row = QHBoxLayout()
        for label, edit in (("Only agents tagged:", self.include_tags), ("Never agents tagged:", self.exclude_tags)):
            tag_row.addWidget(QLabel(label))
            tag_row.addWidget(edit, 1)
        tag_row.addWidget(self.fleet_tags, 1)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.ring = QtRingDiagram()
        self.ring.set_diagram(None, "No plan yet: place the model to see its ring.")
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.table)
        split.addWidget(self.ring)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 1)
        split.setSizes([560, 520])
        self.summary = QLabel("No plan yet.")
        self.summary.setWordWrap(True)
        self.moe = QLabel()
        self.moe.setWordWrap(True)
        self.moe.setVisible(False)
        self.explanation = QLabel()
        self.explanation.setWordWrap(True)
        self.explanation.setStyleSheet("color: #b3261e;")
        self.explanation.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.splits_row = QHBoxLayout()
        self.splits_row.addWidget(QLabel("Split points (first layer of each later stage):"))
        self.splits_row.addStretch(1)
        self.agents = QListWidget()
        self.agents.setMaximumHeight(90)
        self.resolve_button = QPushButton("Re-solve without unchecked agents")
        self.resolve_button.clicked.connect(self.resolve)
        adjust = QHBoxLayout()
        adjust.addWidget(self.agents, 1)
        adjust.addWidget(self.resolve_button)

        box = QVBoxLayout(self)
        box.addWidget(self.model_label)
        box.addLayout(controls)
        box.addLayout(tag_row)
        box.addWidget(split, 1)
        box.addWidget(self.summary)
        box.addWidget(self.moe)
        box.addWidget(self.explanation)
        self.layouts = QtLayoutsView()
        box.addWidget(self.layouts)
        box.addLayout(self.splits_row)
        box.addWidget(QLabel("Agents the plan may use:"))
        box.addLayout(adjust)
        self._update_buttons()

    # ---- actions ---------------------------------------------------------------------------------

    def request(self) -> PlacementRequest:
        objective: Objective = "throughput" if self.objective.currentText() == "throughput" else "latency"
        return PlacementRequest(objective=objective, n_streams=self.streams.value())

    def tags(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(include, exclude) from the tag fields; TagError for one that is not a tag."""
        return (tags_from_text(self.include_tags.text(), "only agents tagged"),
                tags_from_text(self.exclude_tags.text(), "never agents tagged"))

    def left_out(self) -> set[str]:
        return {self.agents.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.agents.count())
                if self.agents.item(i).checkState() != Qt.CheckState.Checked}

    def place(self) -> None:
        model = self.session.model
        if model is None or self.busy:
            return
        request, context = self.request(), self.context.value()
        try:
            include, exclude = self.tags()
        except DeskfleetError as exc:
            self.explanation.setText(str(exc))
            return
        self._busy(f"Placing {model.name}: measuring links and calibrating the agents' devices…")

        def done(result) -> None:
            inputs, plan, tokens, reason = result
            self._idle()
            self._show_context(tokens, reason)
            self.session.set_plan(plan, inputs, request=request, context=context)

        self.bridge.place(model, request, None if context == AUTO else context, self.left_out(), done,
                          self._failed, include_tags=include, exclude_tags=exclude)

    def resolve(self) -> None:
        inputs = self.session.inputs
        if inputs is None or self.busy:
            return
        request = self.request()
        if request.n_streams != self.session.request.n_streams or self.context.value() != self.session.context:
            self.place()  # the memory profile depends on streams and context: measure again
            return
        try:
            include, exclude = self.tags()
        except DeskfleetError as exc:
            self.explanation.setText(str(exc))
            return
        self._busy("Solving again…")

        def done(plan: Plan) -> None:
            self._idle()
            self.session.set_plan(plan, request=request)

        self.bridge.solve(inputs, request, self.left_out(), done, self._failed, include_tags=include,
                          exclude_tags=exclude)

    def _show_context(self, tokens: int, reason: str) -> None:
        self.context_reason.setText(f"{tokens:,} tokens: {reason or 'as given'}")

    def move_split(self) -> None:
        """Re-time the current plan with the split points in the spin boxes."""
        plan, inputs = self.session.plan, self.session.inputs
        if plan is None or inputs is None:
            return
        firsts = [b.value() for b in self.split_boxes]
        if tuple(firsts) == stage_firsts(plan):
            return
        try:
            adjusted = retime(inputs, plan, firsts)
        except DeskfleetError as exc:
            self.explanation.setText(str(exc))
            return
        self.session.set_plan(adjusted)

    def _failed(self, exc: BaseException) -> None:
        self._idle()
        self.session.set_plan(None)
        self.explanation.setText(str(exc))
        self.summary.setText("No plan.")

    def _busy(self, text: str) -> None:
        self.busy = True
        self.explanation.clear()
        self.summary.setText(text)
        self._update_buttons()

    def _idle(self) -> None:
        self.busy = False
        self._update_buttons()

    # ---- session -> widgets ----------------------------------------------------------------------

    def _on_session(self, what: str) -> None:
        if what == MODEL:
            model, spec = self.session.model, self.session.spec
            self.model_label.setText("Model: choose one on the Models page" if model is None else
                                     f"Model: {model.name} ({spec.weights} weights)")
            self.context_reason.setText(AUTO_HINT)  # the last placement's context was another model's
        elif what == PLAN:
            self._show_plan(self.session.plan)
            if self.layouts.inputs is not self.session.inputs:
                self.layouts.show_inputs(self.session.inputs, self.session.request.headroom)
        self._update_buttons()

    def _on_event(self, event: Event) -> None:
        if event.kind is EventKind.METRICS:
            self.layouts.take_metrics(event.data.get("rings", {}))

    def _on_records(self, records: tuple[AgentRecord, ...]) -> None:
        self.fleet_tags.setText(fleet_tags_text(records))

    def _show_plan(self, plan: Plan | None) -> None:
        note = moe_note(self.session.inputs) if plan is not None else ""
        self.moe.setText(note)
        self.moe.setVisible(bool(note))
        stages = plan.stages if plan is not None else ()
        hops = plan.hop_ms if plan is not None else ()
        self.ring.set_diagram(None if plan is None else RingDiagram.from_plan(plan, self._names()),
                              "No plan yet: place the model to see its ring." if plan is None else None)
        self.table.setRowCount(len(stages))
        for k, s in enumerate(stages):
            values = (str(k), self.session.name(s.pc_id), s.device_id.rsplit("/", 1)[-1],
                      f"{s.first_layer}-{s.last_layer} ({s.n_layers})", f"{s.compute_ms:.2f}",
                      f"{s.memory_bytes / 1e6:.1f} MB", f"{hops[k + 1]:.2f}")
            for col, value in enumerate(values):
                self.table.setItem(k, col, QTableWidgetItem(value))
        if plan is None:
            if not self.busy and not self.explanation.text():
                self.summary.setText("No plan yet.")
            self._build_splits(None)
            return
        by_hand = not plan.optimal and plan.gap is None and self.session.inputs is not None
        kind = "adjusted by hand" if by_hand else plan_quality(plan)
        text = (f"Predicted {plan.tok_s:.1f} tok/s for one stream ({plan.per_token_ms:.2f} ms/token, {kind}); "
                f"{plan.n_streams} stream(s): {plan.aggregate_tok_s:.1f} tok/s aggregate; "
                f"bottleneck {plan.bottleneck_ms:.2f} ms; console → stage 0 {plan.hop_ms[0]:.2f} ms.")
        if plan.excluded:
            text += " Left out: " + ", ".join(f"{self.session.name(e.pc_id)} ({e.reason})" for e in plan.excluded)
        self.summary.setText(text)
        warnings = memory_warnings(self.session.inputs, plan, self.session.request.headroom) \
            if self.session.inputs is not None else []
        self.explanation.setText("This plan does not fit: " + "; ".join(warnings) if warnings else "")
        self._build_splits(plan)
        self._fill_agents()

    def _build_splits(self, plan: Plan | None) -> None:
        firsts = stage_firsts(plan) if plan is not None else ()
        if len(firsts) == len(self.split_boxes):
            for box, first in zip(self.split_boxes, firsts, strict=True):
                box.blockSignals(True)
                box.setValue(first)
                box.blockSignals(False)
            return
        for box in self.split_boxes:
            self.splits_row.removeWidget(box)
            box.deleteLater()
        layers = self.session.inputs.model.n_layers if self.session.inputs is not None else 1
        self.split_boxes = []
        for first in firsts:
            box = QSpinBox()
            box.setRange(1, max(1, layers - 1))
            box.setValue(first)
            box.valueChanged.connect(lambda _: self.move_split())
            self.splits_row.insertWidget(self.splits_row.count() - 1, box)
            self.split_boxes.append(box)

    def _names(self) -> dict[str, str]:
        inputs = self.session.inputs
        return {} if inputs is None else dict(inputs.names)

    def _fill_agents(self) -> None:
        inputs = self.session.inputs
        if inputs is None:
            return
        left_out = self.left_out()
        self.agents.clear()
        for pc in inputs.pcs:
            if not pc.approved and pc.pc_id not in left_out:
                continue
            tags = next((r.tags for r in self.bridge.records if r.node_id == pc.pc_id), ())
            item = QListWidgetItem(inputs.name(pc.pc_id) + (f"  [{', '.join(tags)}]" if tags else ""))
            item.setData(Qt.ItemDataRole.UserRole, pc.pc_id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Unchecked if pc.pc_id in left_out else Qt.CheckState.Checked)
            self.agents.addItem(item)

    def _update_buttons(self) -> None:
        self.place_button.setEnabled(not self.busy and self.session.model is not None and self.bridge.running)
        self.resolve_button.setEnabled(not self.busy and self.session.inputs is not None)
