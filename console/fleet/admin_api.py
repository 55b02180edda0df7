"""The fleet service's admin API (aiohttp): the routes of docs/ADMIN_API.md over the
:class:`~console.fleet.fleet_service.FleetService`, on two listeners of one application:

- ``<state_dir>/admin.sock``, a unix socket made 0600 in the service's 0700 state dir: whoever
  can open it is the local admin;
- HTTPS with mutual TLS on ``admin_host:admin_port``: the handshake takes only a certificate of
  the fleet CA with role ``admin`` (``Credentials.server_context(admit=ADMIN_ROLES)``), and the
  request handler checks the role again, so an agent's or the service's own certificate is
  refused with 403 even by a TLS stack that let it through.

Handlers are thin: parse the body (:mod:`console.fleet_api.admin_shapes`), call the service, answer
JSON. Each action is logged with who asked (the admin certificate's name, or "local").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from console.fleet.admin_certs import AdminCertBook, AdminCertError
from console.fleet.errors import (
    AgentRefusedError,
    AgentUnreachableError,
    ExportNotFoundError,
    ForeignAgentError,
    ModelPathError,
    UnknownAgentError,
)
from console.fleet.join_tokens import issue_options
from console.fleet.served_rings import RingIdError
from console.fleet.service_events import MAX_PAGE_BYTES, PAGE_EVENTS, JobNotFoundError
from console.fleet.service_ring import RingStateError
from console.fleet_api.admin_shapes import (
    ShapeError,
    export_plan_from_json,
    field,
    plan_from_json,
    plan_json,
    request_from_json,
    spec_from_json,
    strings,
)
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.feed import EventKind
from engine.api.guard import JSON_TYPE, LOOPBACK_NAMES, host_name, is_ip
from engine.errors import DeskfleetError, TagError, TokenPolicyError
from engine.http_limits import LimitedAppRunner, LimitedSite
from engine.trust.fleet_ca import ADMIN_ROLES, Role, peer_role

FleetService = Any  # console.fleet.fleet_service.FleetService: it imports this module, never the reverse

log = logging.getLogger("deskfleet.fleet.admin")

PREFIX = "/admin/v1"
ADMIN_SOCKET = "admin.sock"  # in the service's state dir
CONSOLE_KEY = "console"
MAX_BODY = 4 << 20  # a plan with its inputs is a few KiB; a body of MiBs is not one
WHO: web.RequestKey[str] = web.RequestKey("deskfleet_admin", str)

_NOT_FOUND = ("ExportNotFoundError", "UnknownAgentError", "RingNotFoundError", "PlacementNotFoundError",
              "ModelNotFoundError", "JobNotFoundError", "TokenNotFoundError")
# (error class, HTTP status, code); the first match wins; another DeskfleetError is a 409 conflict
ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
    (ShapeError, 400, "bad_request"), (RingIdError, 400, "bad_request"), (ModelPathError, 400, "bad_request"),
    (TokenPolicyError, 400, "bad_request"), (TagError, 400, "bad_request"),
    (UnknownAgentError, 404, "not_found"), (ExportNotFoundError, 404, "not_found"),
    (JobNotFoundError, 404, "not_found"),
    (RingStateError, 409, "conflict"), (ForeignAgentError, 409, "conflict"),
    (AgentUnreachableError, 502, "agent_unreachable"), (AgentRefusedError, 502, "agent_refused"),
)


class AdminError(web.HTTPException):
    def __init__(self, status: int, code: str, message: str) -> None:
        self.status_code = status
        super().__init__(text=json.dumps({"error": {"code": code, "message": message}}),
                         content_type="application/json")


def _error_for(exc: BaseException) -> AdminError:
    for kind, status, code in ERRORS:
        if isinstance(exc, kind):
            return AdminError(status, code, str(exc))
    if type(exc).__name__ in _NOT_FOUND:
        return AdminError(404, "not_found", str(exc))
    if isinstance(exc, DeskfleetError):
        return AdminError(409, "conflict", str(exc))
    return AdminError(500, "internal", f"the service failed: {type(exc).__name__}: {exc}")


def caller(request: web.Request) -> str:
    """Who is asking: "local" on the unix socket, ``admin:<name>`` for an admin certificate.
    Raises 403 for a TLS peer whose certificate is not an admin's."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family == getattr(socket, "AF_UNIX", None):
        return "local"
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise AdminError(403, "forbidden", "the admin API takes an admin certificate of this fleet (or the "
                                           "service's local socket)")
    role = peer_role(der)
    if role not in ADMIN_ROLES:
        raise AdminError(403, "forbidden", f"a {role or 'role-less'} certificate may not use the admin API; "
                                           "issue an admin certificate with `deskfleet fleet admin-cert`")
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    names = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = names[0].value if names else "?"
    return f"admin:{name.decode() if isinstance(name, bytes) else name}"


def _no_constant(name: str) -> Any:
    raise ShapeError(f"the body holds {name}, which is not JSON; send finite numbers")


def check_browser_shape(request: web.Request) -> None:
    """What the admin HTTPS refuses so that a web page in a browser holding an admin certificate
    cannot use it (security review L9): a request with an ``Origin`` header (browsers send one on
    every cross-site and every scripted POST), a body not declared ``application/json`` (a form or
    ``text/plain`` post needs no CORS preflight), and a ``Host`` that is neither an IP address, a
    loopback name nor this machine's name (DNS rebinding)."""
    if "Origin" in request.headers:
        raise AdminError(403, "forbidden", "the admin API does not answer web pages (the request has an Origin "
                                           "header); use the console or `deskfleet fleet`")
    if request.can_read_body and request.content_type != JSON_TYPE:
        raise AdminError(415, "unsupported_media_type", f"a request body must be sent as Content-Type: {JSON_TYPE}, "
                                                        f"not {request.content_type or 'none'!r}")
    name = host_name(request.headers.get("Host", ""))
    if name is None or not (name in _machine_names() or is_ip(name)):
        raise AdminError(421, "wrong_host", f"the admin API does not answer to the host name "
                                            f"{request.headers.get('Host')!r}; address it by IP address or by "
                                            f"this machine's name ({socket.gethostname()})")


@functools.cache
def _machine_names() -> frozenset[str]:
    name = socket.gethostname().lower().rstrip(".")
    short = name.split(".")[0]
    return LOOPBACK_NAMES | {name, short, f"{short}.local"}


def peer_der(request: web.Request) -> bytes | None:
    """The TLS peer's certificate (DER); None on the unix socket."""
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    return ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None


class AdminApi:
    def __init__(self, service: FleetService) -> None:
        self.service = service
        self.admin_certs = AdminCertBook(Path(service.settings.state_dir))

    @web.middleware
    async def guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            request[WHO] = caller(request)
            der = peer_der(request)
            refusal = self.admin_certs.refusal(der) if der else None
            if refusal is not None:  # revoked while this connection was kept alive
                raise AdminError(403, "revoked", refusal)
            if request[WHO] != "local":
                check_browser_shape(request)
            if request.method in ("POST", "DELETE") and request.path != f"{PREFIX}/events":
                log.info("%s: %s %s", request[WHO], request.method, request.path)
            return await handler(request)
        except web.HTTPException as exc:
            if isinstance(exc, AdminError) or exc.status < 400:
                raise
            raise AdminError(exc.status, "not_found" if exc.status == 404 else "bad_request", exc.reason) from exc
        except Exception as exc:
            error = _error_for(exc)
            if error.status_code >= 500:
                log.exception("%s %s failed", request.method, request.path)
            raise error from exc

    @staticmethod
    async def body(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            data = json.loads(await request.text(), parse_constant=_no_constant)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ShapeError(f"the body is not JSON ({exc})") from exc
        except RecursionError:
            raise ShapeError("the body nests too deeply to read (no admin request nests past a few levels)") from None
        if not isinstance(data, dict):
            raise ShapeError("the body must be a JSON object")
        return data

    # ---- routes ----------------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        s, r, j = self.service, app.router, web.json_response
        key = lambda q: q.match_info["key"]  # noqa: E731
        ring = lambda q: q.match_info["ring"]  # noqa: E731

        async def service(q):
            return j(s.service_json())

        async def tokens(q):
            return j(s.new_token(**issue_options(await self.body(q))))

        async def list_tokens(q):
            return j(s.token_desk.listing())

        async def revoke_token(q):
            return j(s.token_desk.revoke(q.match_info["id"]))

        async def token_audit(q):
            lines = s.token_desk.audit.lines() if s.token_desk.audit is not None else []
            return j({"lines": lines[-1000:]})

        async def agents(q):
            return j({"agents": s.agents()})

        async def add_agent(q):
            body = await self.body(q)
            port = field(body, "port", int, default=7210)
            return j({"agent": await s.async_add_address(field(body, "host", str), port)})

        async def approve(q):
            return j({"agent": s.approve(key(q))})

        async def remove(q):
            s.remove(key(q))
            return j({"removed": key(q)})

        async def set_tags(q):
            body = await self.body(q)
            tags = body.get("tags") if isinstance(body, dict) else None
            if not isinstance(body, dict) or "tags" not in body or not (tags is None or isinstance(tags, list)):
                raise ShapeError("the body needs 'tags': a list of tags, or null to let the agent's own count")
            return j({"agent": s.set_tags(key(q), tags)})

        async def pause(q):
            return j({"agent": await s.async_pause(key(q))})

        async def resume(q):
            return j({"agent": await s.async_resume(key(q))})

        async def refresh(q):
            return j({"agents": await s.async_refresh()})

        async def links(q):
            body = await self.body(q)
            return j({"job": s.measure_links(strings(body, "node_ids")).to_json()}, status=202)

        async def models(q):
            return j({"models": s.models()})

        async def add_model(q):
            return j({"model": s.add_model(field(await self.body(q), "path", str))})

        async def exports(q):
            return j({"exports": s.exports()})

        async def place(q):
            body = await self.body(q)
            context = field(body, "context", int, optional=True)
            if context is not None and context < 1:
                raise ShapeError(f"'context' must be a positive number of tokens (or null: the service chooses), "
                                 f"not {context}")
            job = s.place(field(body, "model", str), request_from_json(field(body, "request", dict, default={})),
                          context=context, spec=spec_from_json(field(body, "spec", dict, default={})),
                          leave_out=strings(body, "leave_out"), include_tags=strings(body, "include_tags"),
                          exclude_tags=strings(body, "exclude_tags"))
            return j({"job": job.to_json()}, status=202)

        async def start_export(q):
            body = await self.body(q)
            job = s.start_export(field(body, "model", str), export_plan_from_json(body),
                                 spec=spec_from_json(field(body, "spec", dict, default={})))
            return j({"job": job.to_json()}, status=202)

        async def placement(q):
            return j({"placement": s.placement(q.match_info["id"]).to_json()})

        async def solve(q):
            body = await self.body(q)
            tags = {n: strings(body, n) for n in ("include_tags", "exclude_tags") if body.get(n) is not None}
            plan = await s.async_solve(q.match_info["id"], request_from_json(field(body, "request", dict, default={})),
                                       strings(body, "leave_out"), **tags)
            return j({"plan": plan_json(plan)})

        async def propose_rings(q):
            body = await self.body(q)
            return j(await s.async_propose_rings(
                q.match_info["id"], request_from_json(field(body, "request", dict, default={})),
                standbys=field(body, "standbys", int, default=1), rings=field(body, "max_rings", int, optional=True),
                leave_out=strings(body, "leave_out"),
                **{n: strings(body, n) for n in ("include_tags", "exclude_tags") if body.get(n) is not None}))

        async def rings(q):
            return j({"rings": [x.to_json() for x in s.rings.values()]})

        async def create_ring(q):
            body = await self.body(q)
            standby = strings(body, "standby") if body.get("standby") is not None else None
            made, job = s.create_ring(plan_from_json(field(body, "plan", dict)),
                                      model=field(body, "model", str, optional=True),
                                      export_id=field(body, "export_id", str, optional=True),
                                      spec=spec_from_json(field(body, "spec", dict, default={})),
                                      ring_id=field(body, "ring", str, optional=True), standby=standby)
            return j({"ring": made.to_json(), "job": job.to_json()}, status=202)

        async def get_ring(q):
            return j({"ring": s.ring(ring(q)).to_json()})

        async def rerun(q):
            job = s.rerun(ring(q))
            return j({"ring": s.ring(ring(q)).to_json(), "job": job.to_json()}, status=202)

        async def cancel(q):
            return j({"ring": s.cancel_export(ring(q)).to_json()})

        async def stop_ring(q):
            await s.async_stop_ring(ring(q))
            return j({"stopped": ring(q)})

        async def health(q):
            return j(s.health_json())

        async def metrics(q):
            return j(s.metrics_json())

        async def job(q):
            return j({"job": s.jobs.get(q.match_info["id"]).to_json()})

        async def cancel_job(q):
            return j({"job": s.jobs.cancel(q.match_info["id"]).to_json()})

        async def events(q):
            try:
                after = int(q.query.get("after", "0"))
                timeout = float(q.query.get("timeout", "25"))
                limit = int(q.query.get("limit", str(PAGE_EVENTS)))
            except ValueError as exc:
                raise ShapeError("'after' and 'limit' must be integers and 'timeout' a number of seconds") from exc
            if not 1 <= limit <= PAGE_EVENTS:
                raise ShapeError(f"'limit' must be 1..{PAGE_EVENTS} events")
            poll = await s.feed.poll(after, timeout, limit)
            return web.Response(body=poll.render(MAX_PAGE_BYTES), content_type="application/json")

        p = PREFIX
        r.add_get(f"{p}/service", service)
        r.add_post(f"{p}/tokens", tokens)
        r.add_get(f"{p}/tokens", list_tokens)
        r.add_get(f"{p}/tokens/audit", token_audit)
        r.add_post(f"{p}/tokens/{{id}}/revoke", revoke_token)
        r.add_get(f"{p}/agents", agents)
        r.add_post(f"{p}/agents", add_agent)
        r.add_post(f"{p}/agents/refresh", refresh)
        r.add_post(f"{p}/agents/{{key}}/approve", approve)
        r.add_post(f"{p}/agents/{{key}}/pause", pause)
        r.add_put(f"{p}/agents/{{key}}/tags", set_tags)
        r.add_post(f"{p}/agents/{{key}}/resume", resume)
        r.add_delete(f"{p}/agents/{{key}}", remove)
        r.add_post(f"{p}/links", links)
        r.add_get(f"{p}/models", models)
        r.add_post(f"{p}/models", add_model)
        r.add_get(f"{p}/exports", exports)
        r.add_post(f"{p}/exports", start_export)
        r.add_post(f"{p}/placements", place)
        r.add_get(f"{p}/placements/{{id}}", placement)
        r.add_post(f"{p}/placements/{{id}}/solve", solve)
        r.add_post(f"{p}/placements/{{id}}/rings", propose_rings)
        r.add_get(f"{p}/rings", rings)
        r.add_post(f"{p}/rings", create_ring)
        r.add_get(f"{p}/rings/{{ring}}", get_ring)
        r.add_post(f"{p}/rings/{{ring}}/rerun", rerun)
        r.add_post(f"{p}/rings/{{ring}}/cancel", cancel)
        r.add_delete(f"{p}/rings/{{ring}}", stop_ring)
        r.add_get(f"{p}/health", health)
        r.add_get(f"{p}/metrics", metrics)
        r.add_get(f"{p}/jobs/{{id}}", job)
        r.add_delete(f"{p}/jobs/{{id}}", cancel_job)
        r.add_get(f"{p}/events", events)
        self.extra_routes(app)

    def extra_routes(self, app: web.Application) -> None:
        """The OpenAI API's keys (docs/ADMIN_API.md, "Keys"), kept by the fleet's KeyBook: the running
        API re-reads the book when it changes, so a revocation is refused on its next request; a
        secret is answered once, when issued, and never listed."""
        from engine.api.usage import BY as USAGE_BY
        from engine.api.usage import DEFAULT_SINCE, parse_since, summary
        from engine.trust.key_book import KeyBookError, KeyNameError

        s, j = self.service, web.json_response

        def live() -> list[dict[str, Any]]:
            return [k.to_json() for k in s.host.keys.keys() if k.live]

        def refused(exc: Exception) -> AdminError:
            if isinstance(exc, KeyNameError) and "no live key" in str(exc):
                return AdminError(404, "not_found", str(exc))
            return AdminError(409, "conflict", str(exc))

        async def keys(q):
            return j({"keys": live()})

        def record_fields(body: dict[str, Any]) -> dict[str, Any]:
            """The key record's fields the body gives (holder, holder_kind, group, budgets, limits)."""
            kinds = {"rpm": int, "tpm": int, "holder": str, "holder_kind": str, "group": str, "day_tokens": int,
                     "month_tokens": int}
            return {k: field(body, k, kind) for k, kind in kinds.items() if body.get(k) is not None}

        async def issue(q):
            body = await self.body(q)
            try:
                issued = s.host.keys.issue(field(body, "name", str),
                                           metrics=bool(field(body, "metrics", bool, optional=True)),
                                           **record_fields(body))
            except (KeyNameError, KeyBookError, ValueError) as exc:
                raise refused(exc) from exc
            s.feed.publish(EventKind.KEYS, {"keys": live()})
            return j({**issued.key.to_json(), "secret": issued.secret})

        async def change(q):
            body = await self.body(q)
            try:
                key = s.host.keys.update(q.match_info["name"], **record_fields(body))
            except (KeyNameError, KeyBookError, ValueError) as exc:
                raise refused(exc) from exc
            s.feed.publish(EventKind.KEYS, {"keys": live()})
            return j({"key": key.to_json()})

        async def groups(q):
            return j({"groups": s.host.keys.groups()})

        async def set_group(q):
            body = await self.body(q)
            try:
                s.host.keys.set_group_budget(q.match_info["group"], day_tokens=field(body, "day_tokens", int,
                                                                                    optional=True),
                                             month_tokens=field(body, "month_tokens", int, optional=True))
            except (KeyBookError, ValueError) as exc:
                raise AdminError(400, "bad_request", str(exc)) from exc
            return j({"groups": s.host.keys.groups()})

        async def usage(q):
            by = q.query.get("by", "key")
            if by not in USAGE_BY:
                raise AdminError(400, "bad_request", f"by must be one of {', '.join(USAGE_BY)}, not {by!r}")
            try:
                since = parse_since(q.query.get("since", DEFAULT_SINCE))
                rows = summary(s.host.keys.state_dir, by, since, q.query.get("key"))
            except DeskfleetError as exc:
                raise AdminError(400, "bad_request", str(exc)) from exc
            return j({"by": by, "since": since, "rows": rows})

        async def revoke(q):
            name = q.match_info["name"]
            try:
                s.host.keys.revoke(name)
            except (KeyNameError, KeyBookError) as exc:
                raise refused(exc) from exc
            s.feed.publish(EventKind.KEYS, {"keys": live()})
            return j({"revoked": name})

        async def keys_recent_use(q):
            from console.fleet.key_usage import read_usage

            used = await asyncio.to_thread(read_usage, Path(s.settings.state_dir))
            return j({"usage": {name: use.to_json() for name, use in used.items()}})

        async def console_secret(q):
            if q.match_info["name"] != CONSOLE_KEY:
                raise AdminError(403, "forbidden", "only the console's own key is handed out again; another key's "
                                                   "secret was shown once, when it was issued")
            return j({"secret": s.host.api_key})

        async def admin_certs(q):
            return j({"admin_certs": self.admin_certs.listing()})

        async def revoke_admin_cert(q):
            try:
                revoked = self.admin_certs.revoke(q.match_info["which"])
            except AdminCertError as exc:
                raise AdminError(404, "not_found", str(exc)) from exc
            log.warning("%s revoked the admin certificate %s (%s)", q[WHO], revoked["fingerprint"][:16],
                        revoked.get("name"))
            return j({"admin_cert": revoked})

        app.router.add_get(f"{PREFIX}/admin-certs", admin_certs)
        app.router.add_post(f"{PREFIX}/admin-certs/{{which}}/revoke", revoke_admin_cert)
        app.router.add_get(f"{PREFIX}/keys", keys)
        app.router.add_get(f"{PREFIX}/keys/usage", keys_recent_use)
        app.router.add_post(f"{PREFIX}/keys", issue)
        app.router.add_post(f"{PREFIX}/keys/{{name}}/secret", console_secret)
        app.router.add_delete(f"{PREFIX}/keys/{{name}}", revoke)
        app.router.add_post(f"{PREFIX}/keys/{{name}}", change)
        app.router.add_get(f"{PREFIX}/key-groups", groups)
        app.router.add_post(f"{PREFIX}/key-groups/{{group}}", set_group)
        app.router.add_get(f"{PREFIX}/usage", usage)


ADMIN_CERTS: web.AppKey[AdminCertBook] = web.AppKey("deskfleet_admin_certs", AdminCertBook)


def build_admin_app(service: FleetService) -> web.Application:
    api = AdminApi(service)
    app = web.Application(middlewares=[api.guard], client_max_size=MAX_BODY)
    app[ADMIN_CERTS] = api.admin_certs
    api.routes(app)
    return app


async def async_run_admin(service: FleetService, stack: contextlib.AsyncExitStack) -> str | None:
    """Serve the admin API on the state dir's socket and, unless ``admin_port`` is None, over
    mutual TLS; closed by ``stack``. Returns the HTTPS URL (None: socket only)."""
    settings = service.settings
    app = build_admin_app(service)
    runner = LimitedAppRunner(app, handler_cancellation=True, shutdown_timeout=2.0,
                              access_log=None,  # long-polls and job polls: the actions are logged by the guard
                              what="admin API")
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    path = Path(settings.state_dir) / ADMIN_SOCKET
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket left by a service that was killed (the state dir lock says we own it)
    try:
        await web.UnixSite(runner, str(path)).start()
    except OSError as exc:  # e.g. a path over the 107 bytes a unix socket address holds
        raise FleetServiceError(f"the admin API cannot listen on {path} ({exc}); use a --state-dir with a shorter "
                           "path") from exc
    os.chmod(path, 0o600)
    if settings.admin_port is None:
        return None
    # a revoked admin certificate ends the handshake (and the guard refuses it on a kept-alive connection)
    ctx: ssl.SSLContext = service.host.credentials.server_context(admit=ADMIN_ROLES, refuse=app[ADMIN_CERTS].refusal)
    site = LimitedSite(runner, settings.admin_host, settings.admin_port, ssl_context=ctx)
    try:
        await site.start()
    except OSError as exc:
        raise FleetServiceError(f"the admin API cannot listen on {settings.admin_host}:{settings.admin_port} ({exc}); "
                           "pick another --admin-port (or -1 for the local socket only)") from exc
    port = runner.addresses[-1][1]
    host = f"[{settings.admin_host}]" if ":" in settings.admin_host else settings.admin_host
    return f"https://{host}:{port}"


__all__ = ["AdminApi", "Role", "build_admin_app", "async_run_admin", "caller"]
