"""The agent's control API: HTTPS with mutual TLS against the fleet CA (aiohttp, the same stack
as the OpenAI API).

Any fleet member may read (``GET /v1/status``, ``GET /v1/probe``); only the fleet service may change
anything: a certificate with the fleet service role and, once the agent joined through a fleet service,
that fleet service's node id (pinned at the join; a fresh join is the only way to replace it). A
member the fleet service revoked (its deny list) is refused on every route. ``/v1/link/echo`` is for
the fleet service and for the members the fleet service named as measure targets (``POST /v1/link/expect``,
for a minute), streamed from one shared buffer, a few at a time. Every request is parsed by
:mod:`engine.control.messages` before the service sees it; a bad request gets a 4xx with a message and
changes nothing; every refusal is logged.

Routes (docs/CONTROL_API.md)::

    GET  /v1/status          AgentStatus
    GET  /v1/probe           who this is (unicast discovery), cheap
    POST /v1/assign          Assignment -> stored (the worker restarts if the stage changed)
    POST /v1/fetch           {bandwidth_cap_bytes_s?} -> 202, progress in status
    POST /v1/worker/start    -> 202 (409 until the files are verified)
    POST /v1/worker/stop
    POST /v1/drain           finish the frame in hand, refuse new streams, stop
    POST /v1/pause           {reason?}     POST /v1/resume
    GET  /v1/link/echo?bytes=N   N zero bytes (link probes: the fleet service, or an expected member)
    POST /v1/link/expect     {node_id} -> that member may probe /v1/link/echo for EXPECT_S
    POST /v1/link/measure    {target: HOST:PORT, target_node_id?} -> this agent's link to another agent
    POST /v1/deny            {deny: [node ids], api_key?} -> the fleet service's revocation list (control API +
                             worker) and, after a removal, the API's new key (the tray's chat)
    POST /v1/fleet-api       {api_url} -> the fleet's OpenAI API address, given at approval (the tray's chat)
    POST /v1/calibrate       {export..., stages, device, threads?} -> decode-step times per stage
    POST /v1/spare           Assignment -> 202: hold a warm spare of that stage (a standby's; from the
                             pause's end when paused; 409 when serving another stage or short of memory)
    POST /v1/spare/drop      hold none
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from engine.control.links import MAX_ECHO_BYTES, LinkMeasurement
from engine.control.messages import (
    AgentStatus,
    Assignment,
    ControlRequestError,
    decode_body,
    parse_api_key,
    parse_hostport,
    parse_node_id,
    parse_node_ids,
)
from engine.errors import DeskfleetError
from engine.trust.fleet_ca import Role, peer_node_id, peer_role

log = logging.getLogger(__name__)

ECHO_CHUNK = memoryview(bytes(1 << 20))  # every echo streams slices of this one zero buffer
MAX_ECHOES = 2  # concurrent echoes per agent: a link probe runs one at a time
EXPECT_S = 60.0  # how long a member named by POST /v1/link/expect may probe the echo
MAX_EXPECTED = 64


class ControlledAgent(Protocol):
    """What the control API asks of the agent behind it: one call per route, plus who may give
    orders. :class:`agent.service.service.AgentService` implements it; the API knows nothing else
    of the service. A call refuses with ControlRequestError (its status becomes the answer's)."""

    @property
    def service_node_id(self) -> str | None:
        """The fleet service this agent takes orders from (None: any service-role certificate)."""
        ...

    @property
    def deny(self) -> frozenset[str]:
        """Node ids the fleet service revoked: refused on every route."""
        ...

    def status(self) -> AgentStatus: ...

    def probe(self) -> dict[str, Any]: ...

    async def async_assign(self, assignment: Assignment) -> None: ...

    async def async_begin_fetch(self, bandwidth_cap: int | None = None) -> None: ...

    async def async_start_worker(self) -> None: ...

    async def async_stop_worker(self, *, drain: bool = False) -> None: ...

    async def async_set_remote_pause(self, paused: bool) -> None: ...

    async def async_measure_link(self, host: str, port: int, *, samples: int = 5, nbytes: int = 1 << 20,
                                 node_id: str | None = None) -> LinkMeasurement: ...

    async def async_set_deny(self, deny: tuple[str, ...], *, api_key: str | None = None) -> None: ...

    async def async_set_fleet_api(self, api_url: str) -> None: ...

    async def async_calibrate(self, body: dict[str, Any]) -> list[dict[str, Any]]: ...

    async def async_hold_spare(self, assignment: Assignment) -> None: ...

    async def async_drop_spare(self) -> None: ...


def _peer(request: web.Request) -> tuple[str, Role | None]:
    ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise ControlRequestError("a fleet certificate is required", 403)
    return peer_node_id(der), peer_role(der)


def _json_error(exc: Exception) -> web.Response:
    status = exc.status if isinstance(exc, ControlRequestError) else 409
    return web.json_response({"error": {"message": str(exc), "status": status}}, status=status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _admit(service: ControlledAgent, request: web.Request, *, console_only: bool) -> tuple[str, Role | None]:
    """The caller's (node id, role) from its certificate, or ControlRequestError 403: a revoked
    member anywhere; anyone but the pinned fleet service (or, unpinned, a service-role certificate)
    on a fleet service route."""
    node, role = _peer(request)
    if role is Role.ADMIN:  # the TLS layer refuses it first (fleet_ca.MEMBER_ROLES); never rely on one check
        raise ControlRequestError("an admin certificate is for the fleet service's admin API; agents take "
                                  "orders only from the service", 403)
    if node in service.deny:
        raise ControlRequestError(f"member {node[:16]}… is revoked by the fleet service", 403)
    if console_only and not is_console(service, node, role):
        pinned = service.service_node_id
        raise ControlRequestError(f"{request.path} is for the fleet service only" + (
            f" (this agent joined through fleet service {pinned[:16]}…; join again to change services)"
            if pinned and role is Role.FLEET_SERVICE else ""), 403)
    return node, role


def is_console(service: ControlledAgent, node: str, role: Role | None) -> bool:
    pinned = service.service_node_id
    return role is Role.FLEET_SERVICE and (pinned is None or node == pinned)


def build_app(service: ControlledAgent) -> web.Application:
    app = web.Application(client_max_size=4 << 20)
    expected: dict[str, float] = {}  # node id -> monotonic deadline to probe the echo
    echoes = asyncio.Semaphore(MAX_ECHOES)

    def route(method: str, path: str, *, console_only: bool):
        def wrap(fn: Callable[[web.Request, dict[str, Any]], Awaitable[Any]]) -> Handler:
            async def handler(request: web.Request) -> web.StreamResponse:
                try:
                    _admit(service, request, console_only=console_only)
                    body = decode_body(await request.read()) if method == "POST" else {}
                    result = await fn(request, body)
                except (ControlRequestError, DeskfleetError) as exc:
                    log.warning("control %s %s refused: %s", method, request.path, exc)
                    return _json_error(exc)
                status = 202 if isinstance(result, tuple) else 200
                payload = result[0] if isinstance(result, tuple) else result
                return web.json_response(payload if payload is not None else {"ok": True}, status=status)

            app.router.add_route(method, path, handler)
            return handler

        return wrap

    @route("GET", "/v1/status", console_only=False)
    async def status(request, body):
        return service.status().to_dict()

    @route("GET", "/v1/probe", console_only=False)
    async def probe(request, body):
        return service.probe()

    @route("POST", "/v1/assign", console_only=True)
    async def assign(request, body):
        await service.async_assign(Assignment.from_dict(body))
        return None

    @route("POST", "/v1/fetch", console_only=True)
    async def fetch(request, body):
        cap = body.get("bandwidth_cap_bytes_s")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ControlRequestError("bandwidth_cap_bytes_s must be a positive integer")
        await service.async_begin_fetch(bandwidth_cap=cap)
        return ({"accepted": True},)

    @route("POST", "/v1/worker/start", console_only=True)
    async def start(request, body):
        await service.async_start_worker()
        return ({"accepted": True},)

    @route("POST", "/v1/worker/stop", console_only=True)
    async def stop(request, body):
        await service.async_stop_worker()
        return None

    @route("POST", "/v1/drain", console_only=True)
    async def drain(request, body):
        await service.async_stop_worker(drain=True)
        return None

    @route("POST", "/v1/pause", console_only=True)
    async def pause(request, body):
        await service.async_set_remote_pause(True)
        return None

    @route("POST", "/v1/resume", console_only=True)
    async def resume(request, body):
        await service.async_set_remote_pause(False)
        return None

    async def echo(request: web.Request) -> web.StreamResponse:
        try:
            node, role = _admit(service, request, console_only=False)
            if not is_console(service, node, role) and expected.get(node, 0.0) < time.monotonic():
                raise ControlRequestError("/v1/link/echo is for the fleet service and for members it named as "
                                          "measure targets (POST /v1/link/expect)", 403)
            n = int(request.query.get("bytes", "1"))
            if not 0 <= n <= MAX_ECHO_BYTES:
                raise ControlRequestError(f"bytes must be 0..{MAX_ECHO_BYTES}")
            if echoes.locked():
                raise ControlRequestError(f"{MAX_ECHOES} link probes are running already; try again in a moment",
                                          429)
        except ValueError:
            return _json_error(ControlRequestError("bytes must be an integer"))
        except ControlRequestError as exc:
            log.warning("control GET /v1/link/echo refused: %s", exc)
            return _json_error(exc)
        async with echoes:
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            response.content_length = n
            await response.prepare(request)
            left = n
            while left:
                chunk = ECHO_CHUNK[:min(left, len(ECHO_CHUNK))]
                await response.write(chunk)
                left -= len(chunk)
            await response.write_eof()
            return response

    app.router.add_get("/v1/link/echo", echo)

    @route("POST", "/v1/link/measure", console_only=True)
    async def measure(request, body):
        target = body.get("target")
        host, port = parse_hostport(target, "target")
        samples = body.get("samples", 5)
        nbytes = body.get("bytes", 1 << 20)
        if not (isinstance(samples, int) and 1 <= samples <= 50 and isinstance(nbytes, int)
                and 1 <= nbytes <= MAX_ECHO_BYTES):
            raise ControlRequestError(f"samples must be 1..50 and bytes 1..{MAX_ECHO_BYTES}")
        target_node = body.get("target_node_id")
        target_node = None if target_node is None else parse_node_id(target_node, "target_node_id")
        result = await service.async_measure_link(host, port, samples=samples, nbytes=nbytes, node_id=target_node)
        return {"rtt_ms": result.rtt_ms, "mbit_s": result.mbit_s}

    @route("POST", "/v1/link/expect", console_only=True)
    async def expect(request, body):
        node = parse_node_id(body.get("node_id"), "node_id")
        now = time.monotonic()
        for key in [k for k, t in expected.items() if t < now]:
            del expected[key]
        if len(expected) >= MAX_EXPECTED and node not in expected:
            raise ControlRequestError(f"at most {MAX_EXPECTED} measure targets at once", 429)
        expected[node] = now + EXPECT_S
        return {"expires_in_s": EXPECT_S}

    @route("POST", "/v1/deny", console_only=True)
    async def deny(request, body):
        await service.async_set_deny(parse_node_ids(body.get("deny"), "deny"),
                                     api_key=parse_api_key(body.get("api_key")))
        return None

    @route("POST", "/v1/fleet-api", console_only=True)
    async def fleet_api(request, body):
        url = body.get("api_url")
        if not isinstance(url, str) or not re.match(r"^https?://[^\s]{1,500}$", url):
            raise ControlRequestError(f"api_url must be an http(s) URL, got {url!r}")
        await service.async_set_fleet_api(url)
        return None

    @route("POST", "/v1/spare", console_only=True)
    async def hold_spare(request, body):
        await service.async_hold_spare(Assignment.from_dict(body))
        return ({"accepted": True},)

    @route("POST", "/v1/spare/drop", console_only=True)
    async def drop_spare(request, body):
        await service.async_drop_spare()
        return None

    @route("POST", "/v1/calibrate", console_only=True)
    async def calibrate(request, body):
        return {"timings": await service.async_calibrate(body)}

    return app
