"""The console's headless services in one place: the fleet CA (created on first run and kept
in the console's state dir), join tokens, the enrollment endpoint for joining PCs, and the hub
that serves shards and takes agents' registrations and events.

The Qt console hosts one of these; tests and benchmarks stand one up on loopback the same way.
The CA key is written with mode 0600 next to the token book; moving it into the OS keyring is
noted as follow-up work for the console issue. With ``advertise_on`` the enrollment address is
also advertised over mDNS (:mod:`engine.console_discovery`), so a joining PC needs only the token.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from engine import __version__
from engine.console_discovery import ConsoleAdvertiser, console_advertisement
from engine.enrollment import EnrollmentServer
from engine.fleet_hub import FleetHub
from engine.jointoken import TokenBook
from engine.trust import Credentials, FleetAuthority, Role

CA_CERT = "fleet-ca.crt"
CA_KEY = "fleet-ca.key"


def is_first_run(state_dir: Path) -> bool:
    """Whether the console in ``state_dir`` has no fleet CA yet (the next start creates one)."""
    return not ((state_dir / CA_CERT).exists() and (state_dir / CA_KEY).exists())


def load_or_create_authority(state_dir: Path, name: str = "Deskfleet fleet") -> FleetAuthority:
    """The fleet CA in ``state_dir``; a new one (written 0600) the first time."""
    cert, key = state_dir / CA_CERT, state_dir / CA_KEY
    if cert.exists() and key.exists():
        return FleetAuthority.from_pem(cert.read_bytes(), key.read_bytes())
    state_dir.mkdir(parents=True, exist_ok=True)
    authority = FleetAuthority.create(name)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(authority.key_pem)
    cert.write_bytes(authority.ca_pem)
    return authority


@dataclass
class FleetHost:
    authority: FleetAuthority
    credentials: Credentials  # the console's own fleet certificate (role console)
    tokens: TokenBook
    enrollment: str  # HOST:PORT where PCs redeem join tokens
    hub: FleetHub

    def token(self, ttl_s: float = 24 * 3600) -> str:
        return self.tokens.issue(ttl_s)


@contextlib.asynccontextmanager
async def fleet_host(state_dir: Path, exports: dict[str, Path] | None = None, *, host: str = "127.0.0.1",
                     enrollment_port: int = 0, hub_port: int = 0, advertise_on: str | None = None,
                     name: str = "Deskfleet console") -> AsyncIterator[FleetHost]:
    """Run the console's enrollment endpoint and hub until the block exits.

    ``advertise_on``: an IPv4 address of this machine to advertise the enrollment port on
    (``_deskfleet-join._tcp``); ``name`` is the console's name in that record.
    """
    authority = load_or_create_authority(state_dir)
    creds = authority.issue_credentials("console", Role.CONSOLE)
    book = TokenBook(state_dir / "join-tokens.json", authority.fingerprint)
    enrollment = EnrollmentServer(authority, book, creds)
    enroll_host, enroll_port = await enrollment.async_start(host, enrollment_port)
    hub = FleetHub(creds)
    advertiser = ConsoleAdvertiser(advertise_on) if advertise_on else None
    try:
        for export_id, path in (exports or {}).items():
            hub.publish(export_id, path)
        await hub.async_start(host, hub_port)
        if advertiser is not None:
            await advertiser.async_start(console_advertisement(name, authority.fingerprint, enroll_port,
                                                               advertiser.interface, __version__))
        yield FleetHost(authority, creds, book, f"{enroll_host}:{enroll_port}", hub)
    finally:
        if advertiser is not None:
            await advertiser.async_close()
        await hub.async_close()
        await enrollment.async_close()
