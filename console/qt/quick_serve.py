"""The Dashboard's "Serve the default model": one press places the default model on the approved
PCs with the placement's defaults (objective, context chosen by the service, every approved PC)
and distributes that plan, through the same admin API calls the Placement and Distribution pages
make. It reports where it is in a line of text; the expert pages show the plan and the ring.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QObject, Signal

from console.fleet_api.placement import PlacementInputs
from console.qt.first_steps import default_model
from console.qt.service_bridge import ServiceBridge
from console.qt.service_serving import ServiceServing, ServingPhase
from engine.placement.types import Plan

log = logging.getLogger("deskfleet.console")


class QuickServe(QObject):
    """``start()``; ``changed`` after each step, ``text`` says where it is, ``busy`` while it runs."""

    changed = Signal()

    def __init__(self, bridge: ServiceBridge, serving: ServiceServing, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge, self.serving = bridge, serving
        self.busy = False
        self.text = ""
        self.error = False
        self._default: str | None = None  # the library's default model's name, read once attached
        serving.phase_changed.connect(self._on_phase)
        serving.failed.connect(self._on_failed)

    def model_name(self) -> str:
        """The model a press would serve: the one chosen on the Models page, else the default."""
        if self.bridge.session.model is not None:
            return self.bridge.session.model.name
        if self._default is None and self.bridge.running:
            model = default_model(self.bridge.library.models())
            self._default = model.name if model is not None else ""
        return self._default or ""

    def start(self) -> None:
        if self.busy or not self.bridge.running:
            return
        session = self.bridge.session
        model = session.model or default_model(self.bridge.library.models())
        if model is None:
            self._say("The library has no model to serve: add one on the Models page.", error=True)
            return
        session.choose_model(model)
        self.busy = True
        self._say(f"Placing {model.name} on the approved PCs: measuring their links and calibrating their "
                  "devices (the first time takes a few seconds)…")

        def placed(result: tuple[PlacementInputs, Plan, int, str]) -> None:
            inputs, plan, context, _ = result
            session.set_plan(plan, inputs, context=context)
            self._say(f"Distributing {model.name} over {len(plan.stages)} PC{'s' if len(plan.stages) != 1 else ''}: "
                      "exporting its stages and sending them…")
            self.serving.distribute(plan)

        def failed(exc: BaseException) -> None:
            self.busy = False
            self._say(f"Placing {model.name} failed: {exc}", error=True)

        self.bridge.place(model, session.request, None, (), placed, failed)

    def _on_phase(self, phase: str) -> None:
        if self.busy and phase == ServingPhase.SERVING:
            self.busy = False
            self._say(f"Serving {self.bridge.session.model.name if self.bridge.session.model else 'the model'}.")

    def _on_failed(self, message: str) -> None:
        if self.busy:
            self.busy = False
            self._say(f"The distribution failed: {message} (the Distribution page has the details)", error=True)

    def _say(self, text: str, *, error: bool = False) -> None:
        self.text, self.error = text, error
        if error:
            log.warning("serve the default model: %s", text)
        self.changed.emit()
