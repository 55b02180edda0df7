"""An export the fleet service runs for the Models page (``POST /admin/v1/exports``), with the face
of the in-process :class:`console.fleet.export_job.ExportJob` the page drives: ``state``,
``done``, ``fraction``, ``result``/``reused``/``failure``, ``cancel()``, ``close()``, ``poll()``
(a no-op: news arrives by itself), and ``on_event`` called on the GUI thread with the same
:data:`~console.fleet_api.exports.ExportEvent` objects.

Progress is the feed's ``export`` events carrying this job's id (an event may arrive before the
POST's answer names the job: those are held until it does); the outcome is the job's own
(``AdminClient.async_wait_job``): its result, or its failure or cancellation. Cancel is
``DELETE /admin/v1/jobs/{id}``: the service stops the export process and leaves nothing behind;
the job then ends ``cancelled``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from console.fleet_api.admin_client import AdminClient, AdminJobError
from console.fleet_api.admin_decode import export_from_json
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import (
    ExportCancelled,
    ExportEvent,
    ExportFailed,
    ExportFinished,
    ExportInfo,
    ExportProgress,
    ExportSpec,
)
from console.fleet_api.feed import Event, EventKind
from console.fleet_api.model_entry import ModelEntry
from engine.placement.types import Plan, PlannedStage


class ExportHost(Protocol):
    """What an export job needs of the console's bridge (``console.qt.service_bridge.ServiceBridge``):
    its feed signal, admin client, loop-to-GUI poster, call helper and library."""

    service_event: Any  # a Qt signal of feed.Event (PySide6's SignalInstance is not generic)
    qt_async: Any  # QtAsync
    library: Any  # ServiceLibrary: localised(ExportInfo)

    @property
    def client(self) -> AdminClient: ...

    def call(self, coro: Any, what: str, *args: Any, **kwargs: Any) -> Any: ...

log = logging.getLogger("deskfleet.console")

EXPORT_TIMEOUT_S = 6 * 3600.0  # as long as the service lets an export run


class ServiceExportJob:
    """One export job in the service, followed from the GUI thread. States: pending (the POST is
    on its way), running, cancelling, finished, failed, cancelled."""

    def __init__(self, bridge: ExportHost, model: str, plan: Plan, spec: ExportSpec | None,
                 on_event: Callable[[ExportEvent], None] | None = None) -> None:
        self._bridge = bridge
        self._on_event = on_event or (lambda event: None)
        self.model, self.plan, self.spec = model, plan, spec
        self.job_id: str | None = None
        self.state = "pending"
        self.fraction = 0.0
        self.result: ExportInfo | None = None
        self.reused = False
        self.failure: ExportFailed | None = None
        self._held: list[Mapping[str, Any]] = []  # export events for a job not yet named
        self._started = time.monotonic()
        self._cancel_asked = False
        self._following = True
        bridge.service_event.connect(self._on_service_event)

    def start(self) -> ServiceExportJob:
        client = self._bridge.client

        async def run() -> dict[str, Any]:
            job = await client.async_start_export(self.model, self.plan, spec=self.spec)
            self._bridge.qt_async.post(self._named, str(job["id"]))
            return await client.async_wait_job(str(job["id"]), timeout=EXPORT_TIMEOUT_S)

        self.state = "running"
        self._bridge.call(run(), f"exporting {self.model}", timeout=EXPORT_TIMEOUT_S + 60,
                          on_result=self._finished, on_error=self._ended)
        return self

    @property
    def done(self) -> bool:
        return self.state in ("finished", "failed", "cancelled")

    def poll(self, timeout: float = 0.0) -> list[ExportEvent]:
        """Nothing to drain: the service's news arrives through the bridge's feed."""
        return []

    def cancel(self) -> bool:
        """Ask the service to stop the export; False if the job already ended. The job ends
        ``cancelled`` (with an ExportCancelled event) once the service has stopped it."""
        if self.done:
            return False
        self._cancel_asked = True
        if self.job_id is not None:
            self._send_cancel()
        self.state = "cancelling"
        return True

    def close(self) -> None:
        """The console closes: stop following the job. The export itself goes on in the service
        (closing a console stops nothing); its export joins the library when done."""
        self._disconnect()

    # ---- news (GUI thread) -----------------------------------------------------------------------

    def _named(self, job_id: str) -> None:
        self.job_id = job_id
        held, self._held = self._held, []
        for data in held:
            if data.get("job") == job_id:
                self._progress(data)
        if self._cancel_asked and not self.done:
            self._send_cancel()

    def _send_cancel(self) -> None:
        self._bridge.call(self._bridge.client.async_call("DELETE", f"/jobs/{self.job_id}"), "cancelling the export",
                          on_error=lambda exc: log.info("cancelling export job %s: %s", self.job_id, exc))

    def _on_service_event(self, event: Event) -> None:
        if event.kind is not EventKind.EXPORT or "job" not in event.data or self.done:
            return
        if self.job_id is None:
            self._held.append(event.data)
        elif event.data.get("job") == self.job_id:
            self._progress(event.data)

    def _progress(self, data: Mapping[str, Any]) -> None:
        if data.get("state") != "progress":
            return  # the outcome is the job's (finished with its export, failed, cancelled)
        fraction = float(data.get("fraction", 0.0))
        self.fraction = max(self.fraction, fraction)
        self._on_event(ExportProgress(data.get("stage"), str(data.get("step", "")), fraction))

    def _finished(self, result: dict[str, Any]) -> None:
        self.result = self._bridge.library.localised(export_from_json(result["export"]))
        self.reused = bool(result.get("reused", False))
        self.state, self.fraction = "finished", 1.0
        self._disconnect()
        self._on_event(ExportFinished(self.result, self.reused, time.monotonic() - self._started))

    def _ended(self, exc: BaseException) -> None:
        self._disconnect()
        if isinstance(exc, AdminJobError) and exc.code == "job_cancelled":
            self.state = "cancelled"
            self._on_event(ExportCancelled())
            return
        self.failure = ExportFailed(type(exc).__name__, str(exc) or type(exc).__name__)
        self.state = "failed"
        self._on_event(self.failure)

    def _disconnect(self) -> None:
        if self._following:
            self._following = False
            self._bridge.service_event.disconnect(self._on_service_event)


# ---- what to export: a stage count needs the model's layer count ---------------------------------

def layer_count(entry: ModelEntry) -> int:
    """The model's number of transformer layers, read from its files on this PC (an HF
    checkpoint's config.json, a GGUF's header): what an even split of N stages needs."""
    from export.sources import find_default_gguf

    path = entry.path if entry.path is not None else find_default_gguf()
    if path is None or not Path(path).exists():
        raise FleetServiceError(f"{entry.name}'s files are not on this PC, so an even split cannot be worked out here; "
                           "place the model (Placement page) and export it with the plan's split instead")
    path = Path(path)
    try:
        if path.is_dir():
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            return int(config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"])
        from export.weights.gguf_file import GGUFFile

        fields = GGUFFile(path).fields
        return int(fields[f"{fields['general.architecture']}.block_count"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FleetServiceError(f"cannot read the layer count of {entry.name} ({path}): {exc}") from exc


def even_plan(n_layers: int, stages: int) -> Plan:
    """``stages`` contiguous layer ranges as even as possible, earlier stages one layer longer
    (the exporter's ``--stages N`` split), as a plan the service exports with."""
    if not 1 <= stages <= n_layers:
        raise FleetServiceError(f"{stages} stages is out of range: this model has {n_layers} layers "
                           f"(1..{n_layers} stages)")
    base, extra = divmod(n_layers, stages)
    bounds = [0]
    for i in range(stages):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    planned = tuple(PlannedStage(f"stage-{i}/CPU", f"stage-{i}", bounds[i], bounds[i + 1] - 1, 0.0, 0)
                    for i in range(stages))
    return Plan(stages=planned, hop_ms=(0.0,) * (stages + 1), per_token_ms=0.0, tok_s=0.0, bottleneck_ms=0.0,
                n_streams=1, cycle_ms=0.0, aggregate_tok_s=0.0, objective="latency", optimal=False)
