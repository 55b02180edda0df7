"""The fleet service advertises its OpenAI API over mDNS (``_deskfleet-api._tcp``), so a tray's chat
or another client on the LAN finds it without being told (agents also get ``api_url`` with their
assignment). The record names the fleet (its id: the CA pin's first 16 hex digits), the API's
base path and whether it is HTTPS; the address is the service's interface. Like every mDNS
record it is a claim, not proof: a client checks the fleet id it expects and the API's key or
TLS certificate before trusting it.

Zeroconf is bound to the service's one interface address, as everywhere in Deskfleet.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass

from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from console.fleet_api.errors import FleetServiceError
from engine.discovery.mdns import RecordPublisher
from engine.errors import DiscoveryError

API_SERVICE_TYPE = "_deskfleet-api._tcp.local."
RECORD_TTL_S = 120
ADVERTISE_TIMEOUT_S = 10.0


class ApiAdvertError(FleetServiceError):
    """The API's mDNS record cannot be published, or a record read back is not one of ours."""


@dataclass(frozen=True)
class ApiAdvertisement:
    fleet_id: str
    port: int
    address: str
    path: str = "/v1"
    tls: bool = False
    name: str = "Deskfleet fleet"

    @property
    def instance(self) -> str:
        clean = re.sub(r"[^A-Za-z0-9 _-]", "-", self.name).strip("- ")[:40] or "fleet"
        return f"{clean}-api-{self.fleet_id[:16]}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}:{self.port}{self.path}"

    def to_properties(self) -> dict[str, str]:
        return {"fleet": self.fleet_id, "path": self.path, "tls": "1" if self.tls else "0"}

    @classmethod
    def from_record(cls, properties: Mapping[bytes, bytes | None], port: int, address: str) -> ApiAdvertisement:
        """Parse a record read back (hostile until checked); ApiAdvertError when it is not ours."""
        def text(key: str) -> str:
            value = properties.get(key.encode())
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else ""

        fleet, path, tls = text("fleet"), text("path") or "/v1", text("tls")
        if not re.fullmatch(r"[0-9a-f]{16}", fleet) or not re.fullmatch(r"/[A-Za-z0-9/_-]{0,64}", path) \
                or tls not in ("0", "1") or not 0 < port < 65536:
            raise ApiAdvertError(f"an mDNS record at {address}:{port} is not a Deskfleet API record")
        return cls(fleet, port, address, path, tls == "1")


class ApiAdvertiser:
    """Publishes one ApiAdvertisement on its address until closed (goodbye packets on close)."""

    def __init__(self) -> None:
        self._record: RecordPublisher | None = None

    async def async_start(self, ad: ApiAdvertisement) -> None:
        service = f"{ad.instance}.{API_SERVICE_TYPE}"
        info = ServiceInfo(API_SERVICE_TYPE, service, port=ad.port, properties=ad.to_properties(),
                           parsed_addresses=[ad.address], server=service, host_ttl=RECORD_TTL_S,
                           other_ttl=RECORD_TTL_S)
        try:
            record = RecordPublisher(ad.address, timeout=ADVERTISE_TIMEOUT_S)
            await record.async_publish(info, f"the API {ad.instance!r}")
        except DiscoveryError as exc:
            raise ApiAdvertError(f"{exc}; the API is not advertised") from exc
        self._record = record

    async def async_close(self) -> None:
        record, self._record = self._record, None
        if record is not None:
            await record.async_close()


async def async_find_api(address: str, fleet_id: str, timeout: float = 5.0) -> ApiAdvertisement | None:
    """The API record of fleet ``fleet_id`` seen from ``address`` within ``timeout`` s, or None."""
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

    zc = AsyncZeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
    found: asyncio.Queue[str] = asyncio.Queue()
    browser = AsyncServiceBrowser(zc.zeroconf, API_SERVICE_TYPE,
                                  handlers=[lambda zeroconf, service_type, name, state_change: found.put_nowait(name)])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while (left := deadline - loop.time()) > 0:
            try:
                name = await asyncio.wait_for(found.get(), left)
            except TimeoutError:
                return None
            info = AsyncServiceInfo(API_SERVICE_TYPE, name)
            if not await info.async_request(zc.zeroconf, 3000) or not info.parsed_addresses():
                continue
            try:
                ad = ApiAdvertisement.from_record(info.properties, info.port or 0, info.parsed_addresses()[0])
            except ApiAdvertError:
                continue
            if ad.fleet_id == fleet_id:
                return ad
        return None
    finally:
        await browser.async_cancel()
        await zc.async_close()
