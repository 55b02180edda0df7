"""The console as a client of the fleet service, as the pages see it: signals on the GUI thread
and one method per page action. Every action is a call of the service's admin API
(:mod:`console.fleet_api.admin_client`) and every piece of news comes from its event feed. Nothing
here serves: closing the console closes its client and its loop thread, never the service, so
chats through the API go on.

Which service: ``settings.service_url`` with the admin credentials folder ``settings.admin_cert``
(mutual TLS), else the local one over ``<state_dir>/admin.sock``, started detached when none runs
(:mod:`console.fleet_api.service_locator`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Coroutine
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from console.fleet_api.admin_client import AdminApiError, AdminClient, ServiceUnreachableError
from console.fleet_api.admin_decode import (
    agent_from_json,
    agents_from_json,
    export_from_json,
    inputs_from_json,
    links_from_json,
    model_from_json,
)
from console.fleet_api.admin_shapes import plan_from_json
from console.fleet_api.agent_record import AgentRecord
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import EXPORTS_SUBDIR, ExportEvent, ExportInfo, ExportSpec
from console.fleet_api.feed import Event, EventKind
from console.fleet_api.fleet_settings import FleetSettings
from console.fleet_api.link_report import LinkReport
from console.fleet_api.model_entry import ModelEntry
from console.fleet_api.placement import PlacementInputs
from console.fleet_api.service_locator import async_attach_local
from console.qt.service_export import ServiceExportJob, even_plan, layer_count
from console.qt.session import ConsoleSession
from console.shared.loop_thread import LoopThread
from console.shared.qt_async import QtAsync
from engine.control.fleet_services import is_first_run
from engine.control.hub import AgentEvent
from engine.placement.types import PlacementRequest, Plan
from engine.tasks import start_task
from engine.trust.admin_bundle import read_admin_credentials

log = logging.getLogger("deskfleet.console")

START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0
LINKS_TIMEOUT_S = 180.0
PLACE_TIMEOUT_S = 1800.0
CLOSE_TIMEOUT_S = 15.0
RETRY_S = 1.0  # the feed's pause after the service went away (it may be restarting)

OnResult = Callable[[Any], None] | None
OnError = Callable[[BaseException], None] | None


class NotAttachedError(FleetServiceError):
    """An action needs the fleet service before the console attached to it."""


class ServiceBridge(QObject):
    """Create on the GUI thread, ``start()``, then use; ``close()`` before the QApplication ends."""

    started = Signal()
    start_failed = Signal(str)
    records_changed = Signal(object)  # tuple[AgentRecord, ...]
    hub_event = Signal(object)  # engine.control.hub.AgentEvent
    token_changed = Signal(str)
    error = Signal(str, str)  # (what failed, why)
    service_event = Signal(object)  # admin_client.Event: rings, exports, progress, health, metrics, keys, jobs
    attached = Signal(bool)  # the event feed reaches the service (False while it is away)

    def __init__(self, settings: FleetSettings, *, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.loop = LoopThread("deskfleet-console-loop")
        self.qt_async: QtAsync | None = None
        self.session = ConsoleSession()
        self.library = ServiceLibrary(self)
        self.remote = settings.service_url is not None
        self.first_run = not self.remote and is_first_run(settings.state_dir)  # the service creates the CA
        self._client: AdminClient | None = None  # a loop object; read as ``client``, once attached
        self.service: dict[str, Any] = {}  # GET /admin/v1/service, as the console attached
        self.started_service = False  # this console started the local service (it keeps running after it)
        self.records: tuple[AgentRecord, ...] = ()
        self.token = ""
        self.enrollment = ""
        self.fleet_id = ""
        self._placements: dict[int, str] = {}  # id(PlacementInputs) -> the service's placement id
        self._feed: asyncio.Task | None = None
        self._closers: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._running = False
        self._closed = False
        self._names: tuple[tuple[AgentRecord, ...], dict[str, str]] | None = None
        self._refresh = QTimer(self)
        self._refresh.setInterval(int(settings.refresh_s * 1000))
        self._refresh.timeout.connect(self.refresh)

    @property
    def running(self) -> bool:
        return self._running and not self._closed

    def names(self) -> dict[str, str]:
        """Node id -> name of every joined agent (built once per records snapshot, as pages ask per
        event: read it, do not change it)."""
        if self._names is None or self._names[0] is not self.records:
            self._names = (self.records, {r.node_id: r.name for r in self.records if r.node_id})
        return self._names[1]

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Attach to the service (starting a local one if need be); ``started`` follows."""
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        self.loop.start()
        self.qt_async = QtAsync(self.loop, self)

        def done(result: tuple[dict[str, Any], tuple[AgentRecord, ...], str]) -> None:
            self.service, records, token = result
            self.fleet_id = str(self.service.get("fleet_id", ""))
            self.enrollment = str(self.service.get("enrollment", ""))
            self._running = True
            self._apply_records(records)
            self._set_token(token)
            self._refresh.start()
            self.started.emit()

        def failed(error: BaseException) -> None:
            if not isinstance(error, asyncio.CancelledError):
                log.error("the console did not attach to the fleet service: %s", error)
                self.start_failed.emit(str(error))

        self.qt_async.call(self._async_start(), timeout=START_TIMEOUT_S, what="attaching to the fleet service",
                           on_result=done, on_error=failed)

    async def _async_start(self) -> tuple[dict[str, Any], tuple[AgentRecord, ...], str]:
        s = self.settings
        if s.service_url is not None:
            if s.admin_cert is None:
                raise FleetServiceError(f"attaching to {s.service_url} takes an admin certificate: --admin-cert DIR "
                                   "(from `deskfleet fleet admin-cert NAME --out DIR` on the service's PC)")
            creds = await asyncio.to_thread(read_admin_credentials, s.admin_cert)
            client = self._client = AdminClient.over_tls(s.service_url, creds, service_node_id=s.service_node_id)
        else:
            client, _, self.started_service = await async_attach_local(
                s.state_dir, extra_args=local_service_args(s), timeout=START_TIMEOUT_S - 10)
            self._client = client
            if self.started_service:
                log.info("started the fleet service over %s; it keeps serving after the console closes", s.state_dir)
        service = await self.client.async_service()
        records = agents_from_json(await self.client.async_agents())
        token = await self.client.async_new_token()
        self._feed = start_task(self._async_follow(), name="deskfleet-admin-feed", logger=log)
        return service, records, token

    def restart_service(self, on_result: OnResult = None, on_error: OnError = None) -> None:
        """Start the local fleet service again if none runs over the state dir (the feed then finds
        it: ``attached(True)``); ``on_result(started)``. A remote service is not this PC's to start:
        ``on_result(False)`` at once."""
        if self.remote:
            if on_result is not None:
                on_result(False)
            return
        s = self.settings

        async def attach() -> bool:
            client, _, started = await async_attach_local(s.state_dir, extra_args=local_service_args(s),
                                                          timeout=START_TIMEOUT_S - 10)
            await client.async_close()  # the console's own client reaches it over the same socket
            return started

        self.call(attach(), "starting the fleet service", timeout=START_TIMEOUT_S, on_result=on_result,
                  on_error=on_error)

    def on_close(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``closer()`` on the loop when the console closes (before the client closes)."""
        self._closers.append(closer)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Detach: stop following the service, close the client and the loop thread. The service
        and everything it serves keep running. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._refresh.stop()
        if not self.loop.running:
            return
        try:
            self.loop.run(self._async_close(), timeout, what="closing the console")
        except Exception as exc:
            log.error("the console did not detach cleanly: %s", exc)
        finally:
            self.loop.stop()

    async def _async_close(self) -> None:
        for closer in reversed(self._closers):
            try:
                await closer()
            except Exception:
                log.exception("closing a console view failed")
        if self._feed is not None:
            self._feed.cancel()
            await asyncio.gather(self._feed, return_exceptions=True)
        if self._client is not None:
            await self._client.async_close()

    @property
    def client(self) -> AdminClient:
        """The admin API's client of the service this console attached to."""
        if self._client is None:
            raise NotAttachedError("the console is not attached to a fleet service yet")
        return self._client

    @property
    def ca_pem(self) -> bytes | None:
        """The fleet CA (from the admin client), None before the console attached."""
        return self._client.ca_pem if self._client is not None else None

    # ---- the event feed --------------------------------------------------------------------------

    async def _async_follow(self) -> None:
        after, away = 0, False
        while True:
            try:
                batch = await self.client.async_events(after)
            except AdminApiError as exc:
                if not away:
                    log.warning("lost the fleet service's event feed (%s); retrying", exc)
                    self._post(self.attached.emit, False)
                away = True
                after = 0 if isinstance(exc, ServiceUnreachableError) else after  # a restart: a new snapshot
                await asyncio.sleep(RETRY_S)
                continue
            if away:
                log.info("the fleet service's event feed is back")
                self._post(self.attached.emit, True)
                away = False
            after = batch.next
            newest = max((i for i, e in enumerate(batch.events) if e.kind is EventKind.RECORDS), default=-1)
            for i, event in enumerate(batch.events):
                if event.kind is not EventKind.RECORDS:
                    self._post(self._on_event, event)
                elif i == newest:  # earlier snapshots in the batch are superseded; decoded here, not on the GUI thread
                    self._post_records(event)

    def _post_records(self, event: Event) -> None:
        try:
            records = agents_from_json(event.data)
        except (FleetServiceError, KeyError, TypeError, ValueError) as exc:
            log.warning("a records event from the service did not read: %s", exc)
            return
        self._post(self._on_records, event, records)

    def _on_records(self, event: Event, records: tuple[AgentRecord, ...]) -> None:  # GUI thread
        if not self._closed:
            self._apply_records(records)
            self.service_event.emit(event)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.qt_async is not None and not self._closed:
            self.qt_async.post(fn, *args)

    def _on_event(self, event: Event) -> None:  # GUI thread
        if self._closed:
            return
        try:
            if event.kind is EventKind.TOKEN:
                self._set_token(str(event.data["token"]))
            elif event.kind is EventKind.HUB:
                self.hub_event.emit(AgentEvent(str(event.data["node_id"]), str(event.data["event"]),
                                               dict(event.data.get("body") or {}), time.monotonic()))
            elif event.kind is EventKind.ERROR:
                self.error.emit(str(event.data.get("what", "the service")), str(event.data.get("message", "")))
            self.service_event.emit(event)
        except (FleetServiceError, KeyError, TypeError, ValueError) as exc:
            log.warning("a %s event from the service did not read: %s", event.kind, exc)

    def _apply_records(self, records: tuple[AgentRecord, ...]) -> None:
        self.records = records
        self.records_changed.emit(records)

    def _set_token(self, token: str) -> None:
        self.token = token
        self.token_changed.emit(token)

    # ---- calls -----------------------------------------------------------------------------------

    def call(self, coro: Coroutine[Any, Any, Any], what: str, *, timeout: float = CALL_TIMEOUT_S,
             on_result: OnResult = None, on_error: OnError = None) -> concurrent.futures.Future | None:
        """Run ``coro`` on the loop; ``on_result``/``on_error`` on the GUI thread (``error`` without one)."""
        if not self.running or self.qt_async is None:
            coro.close()
            if on_error is not None:
                on_error(RuntimeError(f"{what}: the console is not attached to a fleet service"))
            return None

        def report(exc: BaseException) -> None:
            if on_error is not None:
                on_error(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                self.error.emit(what, str(exc))

        return self.qt_async.call(coro, timeout=timeout, what=what, on_result=on_result, on_error=report)

    def call_now(self, coro: Coroutine[Any, Any, Any], what: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run ``coro`` and wait for it on the GUI thread: for the short reads the pages need at once
        (a token, the model list); the local socket answers in milliseconds."""
        return self.loop.run(coro, timeout, what)

    def _record(self, answer: dict[str, Any]) -> AgentRecord:
        return agent_from_json(answer["agent"])

    # ---- fleet actions ---------------------------------------------------------------------------

    def new_token(self) -> None:
        self.call(self.client.async_new_token(), "issuing a join token", on_result=self._set_token)

    def issue_token_now(self) -> str:
        token = self.call_now(self.client.async_new_token(), "issuing a join token")
        self._set_token(token)
        return token

    def approve(self, key: str, on_result: OnResult = None, on_error: OnError = None) -> None:
        self.call(self._then(self.client.async_approve(key), self._record), "approving the agent",
                  on_result=on_result, on_error=on_error)

    def remove(self, key: str, on_result: OnResult = None, on_error: OnError = None) -> None:
        self.call(self._then(self.client.async_remove(key), lambda _: None), "removing the agent",
                  on_result=on_result, on_error=on_error)

    def pause(self, key: str, on_result: OnResult = None, on_error: OnError = None) -> None:
        self.call(self._then(self.client.async_pause(key), self._record), "pausing the agent",
                  on_result=on_result, on_error=on_error)

    def resume(self, key: str, on_result: OnResult = None, on_error: OnError = None) -> None:
        self.call(self._then(self.client.async_resume(key), self._record), "resuming the agent",
                  on_result=on_result, on_error=on_error)

    def add_address(self, host: str, port: int, on_result: OnResult = None, on_error: OnError = None) -> None:
        self.call(self._then(self.client.async_add_address(host, port), self._record), f"adding {host}:{port}",
                  on_result=on_result, on_error=on_error)

    def refresh(self) -> None:
        """Ask the service to poll every member now (its records arrive through the feed)."""
        if self.running:
            self.call(self.client.async_refresh(), "refreshing the agents",
                      on_error=lambda exc: log.debug("refresh failed: %s", exc))

    def set_tags(self, key: str, tags: Collection[str] | None, on_error: OnError = None) -> None:
        """The admin's tags for agent ``key`` (None: the agent's own count again); the changed
        record arrives through the feed."""
        self.call(self.client.async_set_tags(key, None if tags is None else list(tags)), "setting the tags",
                  on_error=on_error)

    def measure_links(self, node_ids: Collection[str], on_result: Callable[[LinkReport], None],
                      on_error: OnError = None) -> None:
        self.call(self._then(self.client.async_measure_links(list(node_ids), timeout=LINKS_TIMEOUT_S),
                             links_from_json), "measuring the links", timeout=LINKS_TIMEOUT_S + 10,
                  on_result=on_result, on_error=on_error)

    # ---- placement -------------------------------------------------------------------------------

    def place(self, model: ModelEntry, request: PlacementRequest, context: int | None, leave_out: Collection[str],
              on_result: Callable[[tuple[PlacementInputs, Plan, int, str]], None], on_error: OnError, *,
              include_tags: Collection[str] = (), exclude_tags: Collection[str] = ()) -> None:
        """The service measures, calibrates (cached) and solves for ``model``, keeping to agents
        with ``include_tags`` and none of ``exclude_tags``; ``context`` None: the service's choice.
        The result: (inputs, plan, context used, why that context: "" when given)."""
        spec = self.session.spec

        async def place() -> tuple[PlacementInputs, Plan, int, str]:
            placement = await self.client.async_place(model.name, request, context=context, spec=spec,
                                                      leave_out=leave_out, timeout=PLACE_TIMEOUT_S,
                                                      include_tags=include_tags, exclude_tags=exclude_tags)
            inputs = inputs_from_json(placement["inputs"])
            self._placements[id(inputs)] = str(placement["id"])
            return (inputs, plan_from_json(placement["plan"]), int(placement["context"]),
                    str(placement.get("context_reason") or ""))

        self.call(place(), f"placing {model.name}", timeout=PLACE_TIMEOUT_S + 30, on_result=on_result,
                  on_error=on_error)

    def solve(self, inputs: PlacementInputs, request: PlacementRequest, leave_out: Collection[str],
              on_result: Callable[[Plan], None], on_error: OnError, *, include_tags: Collection[str] = (),
              exclude_tags: Collection[str] = ()) -> None:
        """Re-solve in the service over the inputs its placement kept (with these tags)."""
        placement = self._placements.get(id(inputs))
        if placement is None:
            if on_error is not None:
                on_error(FleetServiceError("these placement inputs did not come from the service; "
                                           "place the model again"))
            return
        self.call(self.client.async_solve(placement, request, leave_out, include_tags=include_tags,
                                          exclude_tags=exclude_tags), "solving the placement",
                  timeout=request.time_limit_s + 40, on_result=on_result, on_error=on_error)

    @staticmethod
    async def _then(coro: Coroutine[Any, Any, Any], fn: Callable[[Any], Any]) -> Any:
        return fn(await coro)


class ServiceLibrary:
    """The model library as the Models page reads it, from the service (its models and exports
    live on the service's PC). Reads wait on the GUI thread for the local socket's answer."""

    def __init__(self, bridge: ServiceBridge) -> None:
        self._bridge = bridge

    def models(self) -> list[ModelEntry]:
        if not self._bridge.running:
            return []
        return [model_from_json(m) for m in self._bridge.call_now(self._bridge.client.async_models(), "listing models")]

    def add_model(self, path: str) -> ModelEntry:
        try:
            return model_from_json(self._bridge.call_now(self._bridge.client.async_add_model(path), "adding a model"))
        except AdminApiError:
            raise
        except Exception as exc:  # the loop's timeout
            raise FleetServiceError(f"adding {path}: {exc}") from exc

    def exports(self) -> list[ExportInfo]:
        """The service's exports; ``path`` is the export's directory when the service is this PC's
        (the Models page then shows its manifest), else only its id."""
        if not self._bridge.running:
            return []
        exports = [export_from_json(e) for e in self._bridge.call_now(self._bridge.client.async_exports(),
                                                                       "listing exports")]
        return [self.localised(e) for e in exports]

    def localised(self, info: ExportInfo) -> ExportInfo:
        """``info`` with its directory on this PC as ``path``, when it is there (a local service)."""
        here = self._bridge.settings.state_dir / EXPORTS_SUBDIR / info.export_id
        return dataclasses.replace(info, path=here) if not self._bridge.remote and here.is_dir() else info

    def start_export(self, model: ModelEntry, *, plan: Plan | None = None, stages: int | None = None,
                     spec: ExportSpec | None = None,
                     on_event: Callable[[ExportEvent], None] | None = None) -> ServiceExportJob:
        """Have the service export ``model`` (an identical export is reused) with ``plan``'s split or
        ``stages`` as even as the exporter makes them; the running job, its events on the GUI thread."""
        if (plan is None) == (stages is None):
            raise ValueError("give exactly one of plan or stages")
        if not self._bridge.running:
            raise FleetServiceError(f"exporting {model.name}: the console is not attached to a fleet service")
        if plan is None:
            assert stages is not None  # exactly one of the two, checked above
            plan = even_plan(layer_count(model), stages)
        return ServiceExportJob(self._bridge, model.name, plan, spec, on_event).start()


def local_service_args(settings: FleetSettings) -> list[str]:
    """The `deskfleet fleet` options a console passes to a local service it starts: its own."""
    return ["--interface", settings.interface, "--api-port", str(settings.api_port),
            "--enrollment-port", str(settings.enrollment_port), "--hub-port", str(settings.hub_port),
            "--data-port", str(settings.data_port), "--runtime", settings.runtime,
            "--admin-port", str(-1 if settings.admin_port is None else settings.admin_port)]
