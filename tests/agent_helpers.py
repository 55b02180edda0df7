"""A console's headless half for agent tests: fleet CA, join tokens, enrollment and the hub that
serves shards — all real TLS on loopback."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from engine.enrollment import EnrollmentServer
from engine.fleet_hub import FleetHub
from engine.jointoken import TokenBook
from engine.trust import Credentials, FleetAuthority, Role


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeIdle:
    """An idle clock a test can poke: ``touch()`` is a keystroke."""

    def __init__(self, idle_s: float = 1e6) -> None:
        self.idle_s = idle_s

    def seconds_since_input(self) -> float | None:
        return self.idle_s


@dataclass
class Console:
    authority: FleetAuthority
    credentials: Credentials
    tokens: TokenBook
    enrollment: str  # HOST:PORT
    hub: FleetHub

    def token(self) -> str:
        return self.tokens.issue()


@contextlib.asynccontextmanager
async def console(tmp: Path, exports: dict[str, Path] | None = None) -> AsyncIterator[Console]:
    authority = FleetAuthority.create("test fleet")
    creds = authority.issue_credentials("console", Role.CONSOLE)
    book = TokenBook(tmp / "tokens.json", authority.fingerprint)
    enrollment = EnrollmentServer(authority, book, creds)
    host, port = await enrollment.async_start("127.0.0.1", 0)
    hub = FleetHub(creds)
    for export_id, path in (exports or {}).items():
        hub.publish(export_id, path)
    await hub.async_start("127.0.0.1", 0)
    try:
        yield Console(authority, creds, book, f"{host}:{port}", hub)
    finally:
        await hub.async_close()
        await enrollment.async_close()
