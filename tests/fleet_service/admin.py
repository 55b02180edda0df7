"""A minimal admin API client for the service tests (the console's own is console/fleet_api/admin_client.py):
JSON over the service's unix socket, or HTTPS with a client certificate."""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp

PREFIX = "/admin/v1"


class Admin:
    def __init__(self, session: aiohttp.ClientSession, base: str, ssl_context: ssl.SSLContext | bool = False) -> None:
        self.session, self.base, self.ssl = session, base, ssl_context

    @classmethod
    def unix(cls, socket_path: Path) -> Admin:
        return cls(aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket_path))), "http://local")

    @classmethod
    def tls(cls, url: str, ctx: ssl.SSLContext) -> Admin:
        return cls(aiohttp.ClientSession(), url, ctx)

    async def close(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> Admin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, method: str, path: str, body: dict | None = None, *,
                   timeout: float = 60.0) -> tuple[int, Any]:
        async with self.session.request(method, f"{self.base}{PREFIX}{path}", json=body, ssl=self.ssl,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.json()

    async def ok(self, method: str, path: str, body: dict | None = None, *, timeout: float = 60.0) -> Any:
        status, data = await self.call(method, path, body, timeout=timeout)
        assert status < 300, f"{method} {path} -> {status} {data}"
        return data

    async def job(self, job_id: str, timeout: float) -> dict:
        """Wait for a job to end (a hang guard: fail after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            job = (await self.ok("GET", f"/jobs/{job_id}"))["job"]
            if job["state"] != "running":
                return job
            assert time.monotonic() < deadline, f"job {job_id} still running after {timeout:g} s: {job}"
            await asyncio.sleep(0.2)

    async def agent_named(self, name: str, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for a in (await self.ok("GET", "/agents"))["agents"]:
                if a["name"] == name and a["verified"]:
                    return a
            assert time.monotonic() < deadline, f"no verified agent {name!r} after {timeout:g} s"
            await asyncio.sleep(0.1)
