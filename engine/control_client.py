"""The console's client for an agent's control API (HTTPS, mutual TLS with the console's certificate)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from engine.control import AgentStatus, Assignment
from engine.errors import DeskfleetError
from engine.trust import Credentials


class ControlError(DeskfleetError):
    """An agent refused a control request (``status`` is its HTTP status) or could not be reached (0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ControlClient:
    """One agent's control API at ``host:port``; every call has a timeout."""

    def __init__(self, credentials: Credentials, host: str, port: int, *, timeout: float = 10.0) -> None:
        self.base = f"https://{host}:{port}"
        self._ssl = credentials.client_context()
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                    timeout: float | None = None) -> dict[str, Any]:
        session_timeout = self._timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
        try:
            async with aiohttp.ClientSession(timeout=session_timeout) as session:
                async with session.request(method, self.base + path, json=body, ssl=self._ssl) as resp:
                    data = await resp.json(content_type=None)
                    if resp.status >= 400:
                        message = (data or {}).get("error", {}).get("message", "") if isinstance(data, dict) else ""
                        raise ControlError(f"{self.base}{path}: HTTP {resp.status}: {message}", resp.status)
                    return data
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
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

    async def async_drain(self) -> None:
        await self._call("POST", "/v1/drain", {})

    async def async_pause(self) -> None:
        await self._call("POST", "/v1/pause", {})

    async def async_resume(self) -> None:
        await self._call("POST", "/v1/resume", {})

    async def async_measure_link(self, target: str, *, samples: int = 5, nbytes: int = 1 << 20) -> dict[str, float]:
        """Ask this agent to measure its link to another agent (``target`` = that agent's control HOST:PORT)."""
        return await self._call("POST", "/v1/link/measure", {"target": target, "samples": samples, "bytes": nbytes})

    async def async_calibrate(self, calibration: dict[str, Any]) -> list[dict[str, Any]]:
        """Time decode steps of a calibration export's stages on the agent (see engine.calibrate)."""
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
