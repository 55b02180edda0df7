"""What the admin has chosen so far, shared by the console's pages: the model and export format
(Models page), the placement and its inputs (Placement page), and what is being served
(Distribution page). A plain observable object, no Qt: pages subscribe and redraw.

Changing the model or the format drops the plan (it was made for another model); a new plan
does not stop what is being served, it only becomes what the next distribution brings up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from console.fleet_api.exports import ExportSpec
from console.fleet_api.model_entry import ModelEntry
from console.fleet_api.placement import PlacementInputs
from engine.placement.types import PlacementRequest, Plan

MODEL, PLAN, SERVING = "model", "plan", "serving"


@dataclass
class Serving:
    """The ring being served: ``api_url`` once the OpenAI API is up."""

    plan: Plan
    export_id: str
    local_stage0: bool
    api_url: str | None = None


@dataclass
class ConsoleSession:
    model: ModelEntry | None = None
    spec: ExportSpec = field(default_factory=ExportSpec)
    request: PlacementRequest = field(default_factory=PlacementRequest)
    context: int = 4096
    inputs: PlacementInputs | None = None
    plan: Plan | None = None
    serving: Serving | None = None
    _listeners: list[Callable[[str], None]] = field(default_factory=list, repr=False)

    def subscribe(self, listener: Callable[[str], None]) -> None:
        """``listener(what)`` with MODEL, PLAN or SERVING after each change."""
        self._listeners.append(listener)

    def _emit(self, what: str) -> None:
        for listener in list(self._listeners):
            listener(what)

    def choose_model(self, model: ModelEntry | None, spec: ExportSpec | None = None) -> None:
        spec = spec or self.spec
        if model == self.model and spec == self.spec:
            return
        self.model, self.spec = model, spec
        self.inputs = self.plan = None
        self._emit(MODEL)
        self._emit(PLAN)

    def set_plan(self, plan: Plan | None, inputs: PlacementInputs | None = None, *,
                 request: PlacementRequest | None = None, context: int | None = None) -> None:
        """A new or adjusted plan (``inputs`` kept when not given)."""
        self.plan = plan
        self.inputs = inputs if inputs is not None else self.inputs
        self.request = request or self.request
        self.context = context if context is not None else self.context
        self._emit(PLAN)

    def set_serving(self, serving: Serving | None) -> None:
        self.serving = serving
        self._emit(SERVING)

    def name(self, node_id: str) -> str:
        """An agent's name as placement saw it (its node id's start otherwise)."""
        return self.inputs.name(node_id) if self.inputs is not None else node_id[:12]
