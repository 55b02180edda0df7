"""The console's side of the fleet service's admin API (docs/ADMIN_API.md): one asyncio client,
no Qt, over the service's unix socket (the local admin) or HTTPS with mutual TLS (an admin
certificate the fleet CA issued, checked against a service certificate of the ``console`` role).

Every page action of the console is one call here; long actions answer a job that
:meth:`AdminClient.async_wait_job` follows to its result. News (records, tokens, rings, health,
progress) arrives through :meth:`AdminClient.async_events`, a long poll the bridge loops on.
Answers are decoded by :mod:`console.fleet_api.admin_decode` and :mod:`console.fleet_api.admin_shapes`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from console.fleet_api.admin_shapes import plan_from_json, plan_json, request_json, spec_json
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import ExportSpec
from console.fleet_api.feed import KINDS, Event, EventBatch, EventKind
from engine.control.fleet_services import CA_CERT
from engine.placement.types import PlacementRequest, Plan
from engine.trust.fleet_ca import Credentials, Role
from engine.trust.tls_peer import PeerCheckingConnector, PeerIdentityError, expect_peer

log = logging.getLogger(__name__)

PREFIX = "/admin/v1"
CALL_TIMEOUT_S = 30.0
POLL_TIMEOUT_S = 25.0  # the event feed's long poll (the service caps it at 60)
JOB_POLL_S = 0.25
MAX_ANSWER_BYTES = 64 << 20


class AdminApiError(FleetServiceError):
    """The fleet service refused an admin call: ``status`` is the HTTP status, ``code`` the
    service's error code (bad_request, forbidden, not_found, conflict, unavailable, internal);
    the message is the service's, written for a person."""

    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ServiceUnreachableError(AdminApiError):
    """The fleet service did not answer at all (not running, wrong address, a TLS refusal): the
    message says where the console looked."""


class AdminJobError(AdminApiError):
    """A job of the service (links, placement, a ring) failed or was cancelled; the message is why."""


async def _async_read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or its first ``limit`` bytes: ``content.read(n)`` alone returns what has arrived so
    far (the records of 1,000 agents came cut at ~200 kB and failed as "not JSON")."""
    raw = bytearray()
    while len(raw) < limit and (chunk := await resp.content.read(limit - len(raw))):
        raw += chunk
    return bytes(raw)


class AdminClient:
    """``async with AdminClient.over_socket(path) as c:`` or ``AdminClient.over_tls(url, creds)``."""

    def __init__(self, base: str, connector_factory, where: str, *, ca_pem: bytes | None = None) -> None:
        self._base = base.rstrip("/")
        self._connector_factory = connector_factory
        self._session: aiohttp.ClientSession | None = None
        self.where = where  # for messages: "the local fleet service (…/admin.sock)" or the URL
        self.ca_pem = ca_pem  # the fleet CA: what the console's chat trusts an https API by

    @classmethod
    def over_socket(cls, path: Path) -> AdminClient:
        """The local admin: ``<state_dir>/admin.sock`` (the file's 0600 mode is the permission)."""
        ca = path.parent / CA_CERT  # the service's state dir holds the fleet CA's certificate
        return cls("http://fleet-service", lambda: aiohttp.UnixConnector(path=str(path)),
                   f"the local fleet service ({path})", ca_pem=ca.read_bytes() if ca.is_file() else None)

    @classmethod
    def over_tls(cls, url: str, credentials: Credentials, *, service_node_id: str | None = None) -> AdminClient:
        """An admin elsewhere: ``url`` is ``https://host:port``; ``credentials`` an admin's. The
        server must present this fleet's CA's ``console``-role certificate (and ``service_node_id``
        when given), or nothing is sent."""
        if not url.startswith("https://"):
            raise AdminApiError(f"{url} is not an https:// address: the admin API is served over mutual TLS "
                                "(or the local socket) only")
        if credentials.role is not Role.ADMIN:
            raise AdminApiError(f"the certificate given is of the {credentials.role or 'no'} role; the admin API "
                                "takes admin certificates (`deskfleet fleet admin-cert NAME --out DIR`)")
        ctx = credentials.client_context()
        check = expect_peer(Role.FLEET_SERVICE, service_node_id, what=f"the fleet service at {url}")
        return cls(url, lambda: PeerCheckingConnector(check, ssl=ctx), f"the fleet service at {url}",
                   ca_pem=credentials.ca_pem)

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.async_close()

    async def async_close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=self._connector_factory())
        return self._session

    async def async_call(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                         timeout: float = CALL_TIMEOUT_S, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One route (``path`` after /admin/v1) -> its JSON object; AdminApiError otherwise."""
        url = f"{self._base}{PREFIX}{path}"
        try:
            async with self._http().request(method, url, json=body, params=query,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                raw = await _async_read_at_most(resp, MAX_ANSWER_BYTES + 1)
                status = resp.status
        except PeerIdentityError as exc:
            raise ServiceUnreachableError(f"{self.where} is not the fleet service: {exc}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ServiceUnreachableError(f"{self.where} did not answer ({exc.__class__.__name__}: {exc}); is "
                                          "`deskfleet fleet` running?") from exc
        except TimeoutError as exc:
            raise ServiceUnreachableError(f"{self.where} did not answer {method} {path} within {timeout:g} s") from exc
        if len(raw) > MAX_ANSWER_BYTES:
            raise AdminApiError(f"{self.where} answered {path} with more than {MAX_ANSWER_BYTES} bytes", status)
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise AdminApiError(f"{self.where} answered {method} {path} with HTTP {status} that is not JSON", status) \
                from exc
        if status >= 400 or not isinstance(answer, dict):
            err = answer.get("error", {}) if isinstance(answer, dict) else {}
            message = err.get("message") if isinstance(err, dict) else None
            raise AdminApiError(message or f"{self.where} answered {method} {path} with HTTP {status}", status,
                                err.get("code", "") if isinstance(err, dict) else "")
        return answer

    # ---- service, tokens, agents -----------------------------------------------------------------

    async def async_service(self) -> dict[str, Any]:
        return await self.async_call("GET", "/service")

    async def async_new_token(self, ttl_s: float | None = None) -> str:
        body = {} if ttl_s is None else {"ttl_s": ttl_s}
        return str((await self.async_call("POST", "/tokens", body))["token"])

    async def async_issue_token(self, *, uses: int = 1, ttl_s: float | None = 24 * 3600.0, auto_approve: bool = False,
                                label: str = "") -> dict[str, Any]:
        """A join token of ``uses`` PCs for ``ttl_s`` s (None: no expiry): ``{"token", "expires_at", "token_info"}``."""
        body = {"uses": uses, "ttl_s": ttl_s, "auto_approve": auto_approve, "label": label}
        return await self.async_call("POST", "/tokens", body)

    async def async_tokens(self) -> list[dict[str, Any]]:
        """Every join token the service keeps, newest first (no secrets): id, label, uses, used, state, ..."""
        return list((await self.async_call("GET", "/tokens"))["tokens"])

    async def async_revoke_token(self, token_id: str) -> dict[str, Any]:
        return dict((await self.async_call("POST", f"/tokens/{token_id}/revoke"))["token"])

    async def async_token_audit(self) -> list[dict[str, Any]]:
        """The enrolment audit's last lines: who was admitted / approved by which token."""
        return list((await self.async_call("GET", "/tokens/audit"))["lines"])

    async def async_agents(self) -> dict[str, Any]:
        return await self.async_call("GET", "/agents")

    async def async_approve(self, key: str) -> dict[str, Any]:
        return await self.async_call("POST", f"/agents/{key}/approve")

    async def async_remove(self, key: str) -> dict[str, Any]:
        return await self.async_call("DELETE", f"/agents/{key}")

    async def async_pause(self, key: str) -> dict[str, Any]:
        return await self.async_call("POST", f"/agents/{key}/pause")

    async def async_resume(self, key: str) -> dict[str, Any]:
        return await self.async_call("POST", f"/agents/{key}/resume")

    async def async_add_address(self, host: str, port: int) -> dict[str, Any]:
        return await self.async_call("POST", "/agents", {"host": host, "port": port})

    async def async_refresh(self) -> dict[str, Any]:
        return await self.async_call("POST", "/agents/refresh", timeout=60)

    async def async_measure_links(self, node_ids: Collection[str], *, timeout: float = 180.0) -> dict[str, Any]:
        """LINKS, once the service's job measured them."""
        job = (await self.async_call("POST", "/links", {"node_ids": list(node_ids)}))["job"]
        return await self.async_wait_job(job["id"], timeout=timeout)

    # ---- models, exports, placement --------------------------------------------------------------

    async def async_models(self) -> list[dict[str, Any]]:
        return list((await self.async_call("GET", "/models"))["models"])

    async def async_add_model(self, path: str) -> dict[str, Any]:
        return dict((await self.async_call("POST", "/models", {"path": path}))["model"])

    async def async_exports(self) -> list[dict[str, Any]]:
        return list((await self.async_call("GET", "/exports"))["exports"])

    async def async_place(self, model: str, request: PlacementRequest, *, context: int | None, spec: ExportSpec,
                          leave_out: Collection[str] = (), timeout: float = 1800.0, include_tags: Collection[str] = (),
                          exclude_tags: Collection[str] = ()) -> dict[str, Any]:
        """PLACEMENT (its id, inputs, plan, context and the context's reason) once the service
        measured, calibrated and solved; ``context`` None: the service chooses it."""
        body = {"model": model, "context": context, "leave_out": sorted(leave_out), "spec": spec_json(spec),
                "request": request_json(request), "include_tags": sorted(include_tags),
                "exclude_tags": sorted(exclude_tags)}
        job = (await self.async_call("POST", "/placements", body))["job"]
        return dict((await self.async_wait_job(job["id"], timeout=timeout))["placement"])

    async def async_start_export(self, model: str, plan: Plan, *, spec: ExportSpec | None = None) -> dict[str, Any]:
        """Start exporting ``model`` with ``plan``'s split (an identical export is reused): the JOB
        at once; its progress arrives as ``export`` events with the job's id, and
        ``async_wait_job(job["id"], ...)`` gives ``{"export": EXPORT, "reused": bool}``."""
        body: dict[str, Any] = {"model": model, "plan": plan_json(plan)}
        if spec is not None:
            body["spec"] = spec_json(spec)
        return dict((await self.async_call("POST", "/exports", body))["job"])

    async def async_solve(self, placement_id: str, request: PlacementRequest, leave_out: Collection[str], *,
                          include_tags: Collection[str] | None = None,
                          exclude_tags: Collection[str] | None = None) -> Plan:
        """The plan solved again over the placement's inputs (tags None: the placement's own)."""
        body: dict[str, Any] = {"request": request_json(request), "leave_out": sorted(leave_out)}
        for name, tags in (("include_tags", include_tags), ("exclude_tags", exclude_tags)):
            if tags is not None:
                body[name] = sorted(tags)
        answer = await self.async_call("POST", f"/placements/{placement_id}/solve", body,
                                       timeout=request.time_limit_s + 30)
        return plan_from_json(answer["plan"])

    async def async_set_tags(self, key: str, tags: Collection[str] | None) -> dict[str, Any]:
        """The AGENT with the admin's ``tags`` (None: the agent's own count again)."""
        body = {"tags": None if tags is None else list(tags)}
        return dict((await self.async_call("PUT", f"/agents/{key}/tags", body))["agent"])

    # ---- rings -----------------------------------------------------------------------------------

    async def async_rings(self) -> list[dict[str, Any]]:
        return list((await self.async_call("GET", "/rings"))["rings"])

    async def async_create_ring(self, model: str | None, plan: Plan, *, spec: ExportSpec | None = None,
                                ring: str | None = None, standby: Collection[str] | None = None,
                                export_id: str | None = None) -> dict[str, Any]:
        """``{"ring": RING, "job": JOB}`` at once; the export (or ``export_id``, one the service
        already holds) and the distribution go on in the service."""
        body: dict[str, Any] = {"plan": plan_json(plan)}
        if model is not None:
            body["model"] = model
        if export_id is not None:
            body["export_id"] = export_id
        if spec is not None:
            body["spec"] = spec_json(spec)
        if ring is not None:
            body["ring"] = ring
        if standby is not None:
            body["standby"] = list(standby)
        return await self.async_call("POST", "/rings", body)

    async def async_rerun(self, ring: str) -> dict[str, Any]:
        return await self.async_call("POST", f"/rings/{ring}/rerun")

    async def async_cancel(self, ring: str) -> dict[str, Any]:
        return await self.async_call("POST", f"/rings/{ring}/cancel")

    async def async_stop_ring(self, ring: str) -> dict[str, Any]:
        return await self.async_call("DELETE", f"/rings/{ring}", timeout=120)

    async def async_health(self) -> dict[str, Any]:
        return await self.async_call("GET", "/health")

    async def async_metrics(self) -> dict[str, dict[str, float]]:
        return dict((await self.async_call("GET", "/metrics"))["rings"])

    # ---- keys ------------------------------------------------------------------------------------

    async def async_keys(self) -> list[dict[str, Any]]:
        return list((await self.async_call("GET", "/keys"))["keys"])

    async def async_issue_key(self, name: str, *, rpm: int | None = None, tpm: int | None = None,
                              metrics: bool = False) -> dict[str, Any]:
        """``metrics``: the key may read the API's ``/metrics`` (a monitoring system's)."""
        body: dict[str, Any] = {"name": name}
        body.update({k: v for k, v in (("rpm", rpm), ("tpm", tpm)) if v is not None})
        if metrics:
            body["metrics"] = True
        return await self.async_call("POST", "/keys", body)

    async def async_key_usage(self) -> dict[str, dict[str, Any]]:
        """Key name -> {"last": ISO time, "requests": n, "tokens": n} from the audit log's recent tail."""
        return dict((await self.async_call("GET", "/keys/usage"))["usage"])

    async def async_revoke_key(self, name: str) -> dict[str, Any]:
        return await self.async_call("DELETE", f"/keys/{name}")

    async def async_console_secret(self) -> str:
        """The secret of the key named ``console``: what the console's chat calls the API with."""
        return str((await self.async_call("POST", "/keys/console/secret"))["secret"])

    # ---- jobs and the event feed -----------------------------------------------------------------

    async def async_wait_job(self, job_id: str, *, timeout: float) -> Any:
        """The job's result once it is done; AdminJobError if it failed or was cancelled, and
        TimeoutError (after cancelling it) if it outlived ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                job = (await self.async_call("GET", f"/jobs/{job_id}"))["job"]
                if job["state"] == "done":
                    return job.get("result")
                if job["state"] in ("failed", "cancelled"):
                    raise AdminJobError(job.get("error") or f"the service's {job.get('kind')} job was {job['state']}",
                                        409, "job_" + job["state"])
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the service's {job.get('kind')} job {job_id} ran past {timeout:g} s")
                await asyncio.sleep(JOB_POLL_S)
        except (TimeoutError, asyncio.CancelledError):
            try:
                await asyncio.shield(self.async_call("DELETE", f"/jobs/{job_id}", timeout=5))
            except (AdminApiError, asyncio.CancelledError):
                pass  # finished meanwhile, or the service went away: nothing left to cancel
            raise

    async def async_events(self, after: int, *, timeout: float = POLL_TIMEOUT_S) -> EventBatch:
        """Events newer than ``after`` (0: a snapshot first), waiting up to ``timeout`` for one."""
        answer = await self.async_call("GET", "/events", query={"after": str(after), "timeout": f"{timeout:g}"},
                                       timeout=timeout + CALL_TIMEOUT_S)
        # a kind this console does not know (a newer service's) is left out: nothing here would read it
        events = tuple(Event(int(e["seq"]), float(e.get("at", 0.0)), EventKind(e["kind"]), e.get("data") or {})
                       for e in answer.get("events", []) if e.get("kind") in KINDS)
        return EventBatch(events, int(answer.get("next", after)), bool(answer.get("reset", False)))
