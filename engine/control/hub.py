"""The console's side of the control plane, without Qt: the HTTPS endpoint agents talk to.

It serves the shard files of the exports the console published (with HTTP Range, so an
interrupted download resumes), takes registrations from agents on networks that drop multicast
(unicast fallback), and takes the events agents send when they pause or resume. Mutual TLS
against the fleet CA on every route: an agent proves membership with its certificate.

Only files a published export's manifest names can be fetched: the URL path is looked up in
the manifest, never joined onto the file system as given, and only by an agent the console
granted them (:meth:`FleetHub.grant`: the stage of its current assignment, or the stages it
calibrates). A member the console revoked (:meth:`FleetHub.set_deny`) is refused on every route.
Every refusal is logged and answered 403 or 404 without saying more than the caller knows.

What a member may make the hub keep is bounded (:mod:`engine.control.hub_events`): small bodies
(413 beyond), only the fields an event needs, a rate per member (429 beyond), and a log bounded
per member and in all, so one member can neither fill the service nor push out another's news.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from aiohttp import web

from engine.control.hub_events import (
    MAX_EVENT_BODY_BYTES,
    MAX_REGISTRATION_BODY_BYTES,
    AgentEvent,
    EventLog,
    MemberRate,
    ReportRateError,
    check_body_size,
    event_body,
    held_size,
)
from engine.control.messages import ControlRequestError, decode_body
from engine.errors import ManifestError
from engine.http_limits import DEFAULT_LIMITS, ConnectionLimits, LimitedAppRunner, LimitedSite
from engine.shards.manifest import FileEntry, load_manifest, safe_join
from engine.trust.fleet_ca import Credentials, peer_node_id

log = logging.getLogger(__name__)

_CHUNK = 256 << 10
__all__ = ["AgentEvent", "FleetHub"]


class FleetHub:
    """``publish(export_id, export_dir)`` makes an export fetchable at ``shard_url(export_id)``."""

    def __init__(self, credentials: Credentials, *, on_event: Callable[[AgentEvent], None] = lambda e: None,
                 limits: ConnectionLimits = DEFAULT_LIMITS, rate: MemberRate | None = None,
                 log_: EventLog | None = None) -> None:
        self.limits = limits  # connections per peer address and in all
        self.credentials = credentials
        # export id -> (directory, files by path, each stage's file paths)
        self._exports: dict[str, tuple[Path, dict[str, FileEntry], tuple[frozenset[str], ...]]] = {}
        self._on_event = on_event
        self._listeners: list[Callable[[AgentEvent], None]] = []
        self.events = log_ if log_ is not None else EventLog()  # bounded per member and in all
        self.rate = rate if rate is not None else MemberRate()  # reports per member and minute
        self.refused: dict[str, int] = {"too_large": 0, "rate": 0}  # reports refused, by why
        self._rate_warned: set[str] = set()  # members whose refusals were logged at WARNING once
        self.registrations: dict[str, dict] = {}
        self.bytes_served = 0
        self._deny: frozenset[str] = frozenset()
        self._deny_listeners: list[Callable[[frozenset[str]], None]] = []
        self._grants: dict[str, dict[str, frozenset[int]]] = {}  # node id -> export id -> stages
        self._runner: web.AppRunner | None = None
        self.host: str | None = None
        self.port: int | None = None

    def subscribe(self, listener: Callable[[AgentEvent], None]) -> Callable[[], None]:
        """``listener(event)`` on the loop after every registration or event, besides ``on_event``
        (the console's fleet model listens here); returns a function that unsubscribes it."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def publish(self, export_id: str, export_dir: Path) -> None:
        """Make the files ``export_dir``'s manifest names fetchable; ManifestError, and nothing
        published, if the manifest names a path outside the export."""
        manifest = load_manifest(export_dir)
        files = {e.path: e for stage in manifest.stages for e in stage.files}
        files.update({e.path: e for e in manifest.tokenizer_files})
        for rel in files:
            try:
                safe_join(export_dir, rel)
            except ManifestError as exc:
                log.warning("refusing to publish %s from %s: %s", export_id, export_dir, exc)
                raise
        per_stage = tuple(frozenset(e.path for e in stage.files) for stage in manifest.stages)
        self._exports[export_id] = (export_dir, files, per_stage)

    @property
    def deny(self) -> frozenset[str]:
        """The node ids refused on every route (the console's deny list)."""
        return self._deny

    def set_deny(self, deny: Iterable[str]) -> None:
        """Revoked node ids: refused on every route (the console's deny list)."""
        self._deny = frozenset(deny)
        for node_id in self._deny:
            self._grants.pop(node_id, None)
        for listener in list(self._deny_listeners):
            try:
                listener(self._deny)
            except Exception:
                log.exception("deny-list listener failed")

    def subscribe_deny(self, listener: Callable[[frozenset[str]], None]) -> Callable[[], None]:
        """``listener(deny)`` after every change of the deny list (the coordinator's ring listens);
        returns a function that unsubscribes it."""
        self._deny_listeners.append(listener)
        return lambda: self._deny_listeners.remove(listener) if listener in self._deny_listeners else None

    def grant(self, node_id: str, export_id: str, stages: Iterable[int]) -> None:
        """Let ``node_id`` fetch the files of ``stages`` of ``export_id``, in place of what it was
        granted before for that export (an agent serves one stage; a calibration names several)."""
        self._grants.setdefault(node_id, {})[export_id] = frozenset(stages)

    def revoke_grants(self, node_id: str) -> None:
        """``node_id`` may fetch nothing any more (its assignment ended, or it was removed)."""
        self._grants.pop(node_id, None)

    def granted(self, node_id: str, export_id: str) -> frozenset[int]:
        return self._grants.get(node_id, {}).get(export_id, frozenset())

    def shard_url(self, export_id: str) -> str:
        return f"https://{self.host}:{self.port}/v1/shards/{export_id}/"

    @property
    def events_url(self) -> str:
        return f"https://{self.host}:{self.port}/v1/events"

    async def async_start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        app = web.Application(client_max_size=max(MAX_EVENT_BODY_BYTES, MAX_REGISTRATION_BODY_BYTES))
        app.router.add_get("/v1/shards/{export_id}/{path:.+}", self._shard)
        app.router.add_post("/v1/register", self._register)
        app.router.add_post("/v1/events", self._event)
        self._runner = LimitedAppRunner(app, access_log=None, limits=self.limits, what="fleet hub")
        await self._runner.setup()
        site = LimitedSite(self._runner, host, port, ssl_context=self.credentials.server_context())
        await site.start()
        self.host, self.port = host, self._runner.addresses[0][1]
        return self.host, self.port

    async def async_close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _caller(self, request: web.Request) -> str:
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if not der:
            raise web.HTTPForbidden(text="a fleet certificate is required")
        node = peer_node_id(der)
        if node in self._deny:
            log.warning("refused %s %s from revoked member %s", request.method, request.path, node[:16])
            raise web.HTTPForbidden(text="this member's certificate was revoked by the console")
        return node

    async def _shard(self, request: web.Request) -> web.StreamResponse:
        node = self._caller(request)
        export_id, rel = request.match_info["export_id"], request.match_info["path"]
        published = self._exports.get(export_id)
        entry = published[1].get(rel) if published else None
        if published is None or entry is None:
            log.warning("refused shard request for %s/%s: not a published file", export_id, rel)
            raise web.HTTPNotFound(text=f"{export_id}/{rel} is not a published shard file")
        stages = self.granted(node, export_id)
        manifest_stages = published[2]
        if not any(rel in manifest_stages[i] for i in stages if i < len(manifest_stages)):
            log.warning("refused shard request for %s/%s from %s: no current assignment names it",
                        export_id, rel, node[:16])
            raise web.HTTPForbidden(text=f"{export_id}/{rel} is not part of an assignment the console gave "
                                         "this agent")
        path = safe_join(published[0], entry.path)
        try:
            asked = request.http_range.start
        except ValueError:  # aiohttp's parse of a malformed Range header: the client's error, not ours
            raise web.HTTPRequestRangeNotSatisfiable(
                text=f"malformed Range header {request.headers.get('Range')!r}; send 'bytes=N-'",
                headers={"Content-Range": f"bytes */{entry.size}"}) from None
        start = 0
        if asked is not None:
            start = asked
            if not 0 <= start <= entry.size:
                raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{entry.size}"})
        status = 206 if start else 200
        response = web.StreamResponse(status=status, headers={"Content-Type": "application/octet-stream"})
        response.content_length = entry.size - start
        if start:
            response.headers["Content-Range"] = f"bytes {start}-{entry.size - 1}/{entry.size}"
        await response.prepare(request)
        with open(path, "rb") as f:
            f.seek(start)
            while chunk := f.read(_CHUNK):
                await response.write(chunk)
                self.bytes_served += len(chunk)
        await response.write_eof()
        return response

    async def _read_report(self, request: web.Request, node: str, limit: int, what: str) -> dict:
        """The body of a member's report, within ``limit`` bytes and the member's rate; raises
        ControlRequestError 413 or ReportRateError 429 (the rate is charged before the body is read)."""
        if (request.content_length or 0) > limit:
            self.refused["too_large"] += 1
            check_body_size(request.content_length, limit, what)
        wait = self.rate.admit(node)
        if wait is not None:
            self.refused["rate"] += 1
            if node not in self._rate_warned:
                self._rate_warned.add(node)
                log.warning("member %s reports faster than %g a minute; refusing its reports until it slows "
                            "down (logged once)", node[:16], self.rate.per_minute)
            else:
                log.debug("refused a report of %s: over its rate", node[:16])
            raise ReportRateError(f"this member sent more than {self.rate.per_minute:g} reports a minute "
                                  f"(burst {self.rate.burst}); retry in {max(1, math.ceil(wait))} s", wait)
        self._rate_warned.discard(node)
        try:
            raw = await request.read()  # a chunked body past the app's limit: aiohttp stops reading there
        except web.HTTPRequestEntityTooLarge:
            raw = None
        if raw is None or len(raw) > limit:
            self.refused["too_large"] += 1
            raise ControlRequestError(f"{what} body is over the limit of {limit} bytes", 413)
        return decode_body(raw)

    @staticmethod
    def _refusal(exc: ControlRequestError) -> web.Response:
        headers = {"Retry-After": exc.retry_after} if isinstance(exc, ReportRateError) else None
        return web.json_response({"error": {"message": str(exc)}}, status=exc.status, headers=headers)

    async def _register(self, request: web.Request) -> web.Response:
        node = self._caller(request)
        try:
            body = await self._read_report(request, node, MAX_REGISTRATION_BODY_BYTES, "a registration")
        except ControlRequestError as exc:
            return self._refusal(exc)
        self.registrations[node] = {**body, "registered": time.time()}
        self._record(AgentEvent(node, "registered", body, time.monotonic(), held_size(body)))
        return web.json_response({"ok": True})

    async def _event(self, request: web.Request) -> web.Response:
        node = self._caller(request)
        try:
            body = event_body(await self._read_report(request, node, MAX_EVENT_BODY_BYTES, "an event"))
        except ControlRequestError as exc:
            return self._refusal(exc)
        self._record(AgentEvent(node, body["event"], body, time.monotonic(), held_size(body)))
        return web.json_response({"ok": True})

    def _record(self, event: AgentEvent) -> None:
        self.events.append(event)
        log.info("agent %s: %s", event.node_id[:16], event.event)
        self._on_event(event)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken listener must not turn the agent's report into a 500
                log.exception("hub event listener failed")
