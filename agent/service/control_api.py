"""The agent's control API: HTTPS with mutual TLS against the fleet CA (aiohttp, the same stack
as the OpenAI API).

Any fleet member may read (``GET /v1/status``, ``GET /v1/probe`` — agents measure links through
each other); only a certificate with the console role may change anything. Every request is
parsed by :mod:`engine.control` before the service sees it; a bad request gets a 4xx with a
message and changes nothing.

Routes (docs/CONTROL_API.md)::

    GET  /v1/status          AgentStatus
    GET  /v1/probe           who this is (unicast discovery), cheap
    POST /v1/assign          Assignment -> stored (the worker restarts if the stage changed)
    POST /v1/fetch           {bandwidth_cap_bytes_s?} -> 202, progress in status
    POST /v1/worker/start    -> 202 (409 until the files are verified)
    POST /v1/worker/stop
    POST /v1/drain           finish the frame in hand, refuse new streams, stop
    POST /v1/pause           {reason?}     POST /v1/resume
    GET  /v1/link/echo?bytes=N   N bytes (link probes from the console or other agents)
    POST /v1/link/measure    {target: HOST:PORT} -> this agent's link to another agent
    POST /v1/calibrate       {export..., stages, device, threads?} -> decode-step times per stage
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine.control import Assignment, ControlRequestError, decode_body, parse_hostport
from engine.errors import DeskfleetError
from engine.links import MAX_ECHO_BYTES
from engine.trust import Role, peer_node_id, peer_role

if TYPE_CHECKING:
    from agent.service.service import AgentService

log = logging.getLogger(__name__)


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


def build_app(service: AgentService) -> web.Application:
    app = web.Application(client_max_size=4 << 20)

    def route(method: str, path: str, *, console_only: bool):
        def wrap(fn: Callable[[web.Request, dict[str, Any]], Awaitable[Any]]) -> Handler:
            async def handler(request: web.Request) -> web.StreamResponse:
                try:
                    node, role = _peer(request)
                    if console_only and role is not Role.CONSOLE:
                        raise ControlRequestError(f"{request.path} is for the fleet console only", 403)
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
            _peer(request)
            n = int(request.query.get("bytes", "1"))
            if not 0 <= n <= MAX_ECHO_BYTES:
                raise ControlRequestError(f"bytes must be 0..{MAX_ECHO_BYTES}")
        except ValueError:
            return _json_error(ControlRequestError("bytes must be an integer"))
        except ControlRequestError as exc:
            return _json_error(exc)
        return web.Response(body=bytes(n), content_type="application/octet-stream")

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
        result = await service.async_measure_link(host, port, samples=samples, nbytes=nbytes)
        return {"rtt_ms": result.rtt_ms, "mbit_s": result.mbit_s}

    @route("POST", "/v1/calibrate", console_only=True)
    async def calibrate(request, body):
        return {"timings": await service.async_calibrate(body)}

    return app
