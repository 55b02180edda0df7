"""The console's client for an agent's control API (HTTPS, mutual TLS with the console's certificate).

Each new connection is checked before a request goes out: the peer must hold an agent
certificate and, when the client was made for a known agent, the node id it was made for
(``sha256(peer certificate) == node_id``); a client made without one (add by address, a
discovery hint) learns the id from the certificate (``peer_node_id``), never from the answer.
Answers are read with a size limit.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from engine.control.messages import AgentStatus, Assignment
from engine.errors import DeskfleetError
from engine.trust.fleet_ca import Credentials, Role
from engine.trust.tls_peer import (
    PeerCheckingConnector,
    PeerIdentityError,
    async_read_limited,
    expect_peer,
)

MAX_ANSWER_BYTES = 1 << 20  # a status with a full inventory is a few kB; calibration timings less


class ControlError(DeskfleetError):
    """An agent refused a control request (``status`` is its HTTP status) or could not be reached (0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class WrongAgentError(ControlError):
    """The agent's address answered with a certificate that is not the agent's: another node id
    (the address moved to another PC, or a member poses as it) or not an agent certificate.
    Nothing was sent. ``node_id`` is the id that answered."""

    def __init__(self, message: str, node_id: str | None) -> None:
        super().__init__(message, 0)
        self.node_id = node_id


class ControlClient:
    """One agent's control API at ``host:port``; every call has a timeout. ``node_id``: the
    agent that must answer there (None: any agent; ``peer_node_id`` then says which did)."""

    def __init__(self, credentials: Credentials, host: str, port: int, *, timeout: float = 10.0,
                 node_id: str | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self.node_id = node_id
        self.peer_node_id: str | None = None  # the certificate's node id on the last connection
        # ``ssl_context``: ``credentials.client_context()`` made once by a caller that makes many clients
        self._ssl = ssl_context or credentials.client_context()
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._check = expect_peer(Role.AGENT, node_id, what=f"the agent at {self.base}")

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                    timeout: float | None = None) -> dict[str, Any]:
        session_timeout = self._timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
        connector = PeerCheckingConnector(self._check)

        def too_big(message: str) -> ControlError:
            return ControlError(f"{message}; refusing it")

        try:
            async with aiohttp.ClientSession(connector=connector, timeout=session_timeout) as session:
                async with session.request(method, self.base + path, json=body, ssl=self._ssl) as resp:
                    self.peer_node_id = connector.seen
                    data = json.loads(await async_read_limited(resp, MAX_ANSWER_BYTES, too_big) or b"null")
                    if resp.status >= 400:
                        error = data.get("error") if isinstance(data, dict) else None
                        message = error.get("message", "") if isinstance(error, dict) else ""
                        raise ControlError(f"{self.base}{path}: HTTP {resp.status}: {message}", resp.status)
                    return data
        except PeerIdentityError as exc:
            self.peer_node_id = exc.node_id
            raise WrongAgentError(f"{exc}; nothing was sent to it", exc.node_id) from exc
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, RecursionError) as exc:
            raise ControlError(f"cannot reach the agent at {self.base} ({exc!r})") from exc

    async def async_status(self) -> AgentStatus:
        return AgentStatus.from_dict(await self._call("GET", "/v1/status"))

    async def async_probe(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/probe")

    async def async_assign(self, assignment: Assignment) -> None:
        await self._call("POST", "/v1/assign", assignment.to_dict())

    async def async_fetch(self, bandwidth_cap_bytes_s: int | None = None) -> None:
        body = {} if bandwidth_cap_bytes_s is None else {"bandwidth_cap_bytes_s": bandwidth_cap_bytes_s}
        await self._call("POST", "/v1/fetch", body)

    async def async_start_worker(self) -> None:
        await self._call("POST", "/v1/worker/start", {})

    async def async_stop_worker(self) -> None:
        await self._call("POST", "/v1/worker/stop", {})

    async def async_hold_spare(self, assignment: Assignment) -> None:
        """Ask a standby to keep a warm spare of the stage ``assignment`` describes (202)."""
        await self._call("POST", "/v1/spare", assignment.to_dict())

    async def async_drop_spare(self) -> None:
        await self._call("POST", "/v1/spare/drop", {})

    async def async_drain(self) -> None:
        await self._call("POST", "/v1/drain", {})

    async def async_pause(self) -> None:
        await self._call("POST", "/v1/pause", {})

    async def async_resume(self) -> None:
        await self._call("POST", "/v1/resume", {})

    async def async_measure_link(self, target: str, *, samples: int = 5, nbytes: int = 1 << 20,
                                 target_node_id: str | None = None) -> dict[str, float]:
        """Ask this agent to measure its link to another agent (``target`` = that agent's control
        HOST:PORT; ``target_node_id``: who must answer there). Tell the target first
        (:meth:`async_expect_link` on its client) or its echo refuses this agent."""
        body: dict[str, Any] = {"target": target, "samples": samples, "bytes": nbytes}
        if target_node_id is not None:
            body["target_node_id"] = target_node_id
        return await self._call("POST", "/v1/link/measure", body)

    async def async_expect_link(self, prober_node_id: str) -> None:
        """Let member ``prober_node_id`` probe this agent's echo for a minute (a link measure)."""
        await self._call("POST", "/v1/link/expect", {"node_id": prober_node_id})

    async def async_deny(self, deny: list[str] | tuple[str, ...], api_key: str | None = None) -> None:
        """Give the agent the console's deny list (its control API and worker refuse them) and,
        after a removal rotated it, the API's new key for its tray's chat."""
        body: dict[str, Any] = {"deny": list(deny)}
        if api_key is not None:
            body["api_key"] = api_key
        await self._call("POST", "/v1/deny", body)

    async def async_set_fleet_api(self, api_url: str) -> None:
        """Give the agent the fleet's OpenAI API address (at approval: its tray's chat opens)."""
        await self._call("POST", "/v1/fleet-api", {"api_url": api_url})

    async def async_calibrate(self, calibration: dict[str, Any]) -> list[dict[str, Any]]:
        """Time decode steps of a calibration export's stages on the agent (see engine.shards.calibration)."""
        return (await self._call("POST", "/v1/calibrate", calibration, timeout=900))["timings"]

    async def async_wait_for(self, predicate: Callable[[AgentStatus], bool], timeout: float,
                             what: str = "the agent to reach the expected state") -> AgentStatus:
        """Poll the status until ``predicate`` holds; TimeoutError naming ``what`` and the last status."""
        deadline = time.monotonic() + timeout
        status = await self.async_status()
        while not predicate(status):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; last state "
                                   f"{status.state}, worker {status.worker.state} ({status.worker.last_error}), "
                                   f"fetch {status.fetch}")
            await asyncio.sleep(0.2)
            status = await self.async_status()
        return status
