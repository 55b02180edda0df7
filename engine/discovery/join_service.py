"""Finding the console's enrollment address: the console advertises ``_deskfleet-join._tcp``
(DNS-SD service names are at most 15 bytes, so not ``_deskfleet-console``).

A join token pins the fleet (the first 32 hex digits of its CA's sha256), so an employee needs
to type nothing but the token: the agent browses for consoles, keeps those whose record names
the token's pin, and joins at the first one's enrollment port. The record is only a hint, as
hostile as any mDNS record: :func:`engine.control.enrollment.async_join` still checks the CA the console
serves against the pin before it sends anything, so a spoofed record costs a failed join, never
a join to the wrong fleet.

Wire form: the SRV port is the enrollment port, the A records the console's addresses, the TXT
record ``txtvers``, ``pin`` (32 hex), ``fl`` (fleet id, 16 hex) and ``ver``. Zeroconf is bound
to one explicit IPv4 address, as in :mod:`engine.discovery.mdns` (tests use 127.0.0.1 only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from zeroconf import IPVersion, ServiceInfo, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

from engine.discovery.mdns import RECORD_TTL_S, RecordPublisher, _bounded, _check_interface, _zeroconf_on
from engine.errors import DiscoveryError
from engine.tasks import start_task

log = logging.getLogger(__name__)

CONSOLE_SERVICE_TYPE = "_deskfleet-join._tcp.local."
TXT_VERSION = "1"
SEARCH_TIMEOUT_S = 4.0  # a console answers a query within ~1 s on a LAN; 4 s leaves room for loss
_SUFFIX = "." + CONSOLE_SERVICE_TYPE
_PIN = re.compile(r"[0-9a-f]{32}")
_FLEET = re.compile(r"[0-9a-f]{16}")
_VERSION = re.compile(r"[A-Za-z0-9.+_-]{1,32}")
_INSTANCE = re.compile(r"[A-Za-z0-9 _-]{1,63}")


def _fail(detail: str) -> DiscoveryError:
    return DiscoveryError(f"malformed Deskfleet console advertisement: {detail}; ignored")


@dataclass(frozen=True)
class ConsoleAdvertisement:
    """One console as it advertises itself. Validated on construction (ours and a peer's)."""

    instance: str
    ca_pin: str
    fleet_id: str
    version: str
    enrollment_port: int
    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        for what, value, pattern in (("instance", self.instance, _INSTANCE), ("pin", self.ca_pin, _PIN),
                                     ("fleet id", self.fleet_id, _FLEET), ("version", self.version, _VERSION)):
            if not isinstance(value, str) or not pattern.fullmatch(value):
                raise _fail(f"{what} {value!r} is not of the form {pattern.pattern}")
        if type(self.enrollment_port) is not int or not 0 < self.enrollment_port < 65536:
            raise _fail(f"enrollment port {self.enrollment_port!r} is not 1..65535")
        if not self.addresses or len(self.addresses) > 8:
            raise _fail(f"{len(self.addresses)} addresses (1..8 expected)")
        for address in self.addresses:
            try:
                _check_interface(address)
            except DiscoveryError:
                raise _fail(f"address {address!r} is not a usable IPv4 address") from None

    @property
    def service_name(self) -> str:
        return self.instance + _SUFFIX

    @property
    def enrollment(self) -> str:
        """``host:port`` of the first address: what ``async_join`` takes."""
        return f"{self.addresses[0]}:{self.enrollment_port}"

    def to_properties(self) -> dict[str, str]:
        return {"txtvers": TXT_VERSION, "pin": self.ca_pin, "fl": self.fleet_id, "ver": self.version}

    @classmethod
    def from_service_info(cls, info: ServiceInfo) -> ConsoleAdvertisement:
        """Check a resolved record; raises `DiscoveryError` and nothing else."""
        name = info.name if isinstance(info.name, str) else ""
        if not name.lower().endswith(_SUFFIX):
            raise _fail(f"service name {name[:80]!r} is not of type {CONSOLE_SERVICE_TYPE}")
        values = _decode_txt(info.properties or {})
        if values.get("txtvers") != TXT_VERSION:
            raise _fail(f"TXT version {values.get('txtvers')!r} is not {TXT_VERSION!r}")
        if info.port is None:
            raise _fail("no SRV record (enrollment port)")
        return cls(instance=name[: -len(_SUFFIX)], ca_pin=values.get("pin", ""),
                   fleet_id=values.get("fl", ""), version=values.get("ver", ""),
                   enrollment_port=info.port, addresses=tuple(info.parsed_addresses(IPVersion.V4Only)))


def _decode_txt(properties: Mapping[bytes, bytes | None]) -> dict[str, str]:
    values = {}
    for key in ("txtvers", "pin", "fl", "ver"):
        raw = properties.get(key.encode())
        if raw is None or len(raw) > 64:
            raise _fail(f"TXT key {key!r} is missing or too long")
        try:
            values[key] = raw.decode("ascii")
        except UnicodeDecodeError:
            raise _fail(f"TXT key {key!r} is not ASCII") from None
    return values


def console_advertisement(name: str, ca_fingerprint: str, enrollment_port: int, address: str,
                          version: str) -> ConsoleAdvertisement:
    """The console's own record: ``name`` cleaned into one DNS label, the fleet's pin and id."""
    clean = re.sub(r"[^A-Za-z0-9 _-]", "-", name).strip("- ")[:46] or "console"
    fingerprint = ca_fingerprint.lower()
    return ConsoleAdvertisement(instance=f"{clean}-{fingerprint[:16]}", ca_pin=fingerprint[:32],
                                fleet_id=fingerprint[:16], version=version,
                                enrollment_port=enrollment_port, addresses=(address,))


def matching(consoles: tuple[ConsoleAdvertisement, ...], pin: str) -> tuple[ConsoleAdvertisement, ...]:
    """The consoles whose record names ``pin`` (a token's CA pin), in the order they were found."""
    pin = pin.lower()
    return tuple(c for c in consoles if c.ca_pin == pin)


class ConsoleAdvertiser:
    """Publishes the console's enrollment address on one interface until closed."""

    def __init__(self, interface: str, *, timeout: float = 10.0) -> None:
        self._record = RecordPublisher(interface, timeout=timeout)
        self.interface = self._record.interface

    async def async_start(self, ad: ConsoleAdvertisement) -> None:
        info = ServiceInfo(CONSOLE_SERVICE_TYPE, ad.service_name, port=ad.enrollment_port,
                           properties=ad.to_properties(), parsed_addresses=list(ad.addresses),
                           server=ad.service_name, host_ttl=RECORD_TTL_S, other_ttl=RECORD_TTL_S)
        await self._record.async_publish(info, f"the console {ad.instance!r}")

    async def async_close(self) -> None:
        await self._record.async_close()


# console records kept (and looked up at once) in one search: forged ones must outnumber this to
# crowd out the real console, whose address the join-token file can also name (review L7)
MAX_CONSOLES = 64
PIN_GRACE_S = 0.5  # after the first record with the pin, how long others may still answer


async def async_find_consoles(interface: str, *, pin: str | None = None,
                              timeout: float = SEARCH_TIMEOUT_S) -> tuple[ConsoleAdvertisement, ...]:
    """The consoles advertising on ``interface`` within ``timeout`` s; returns shortly after one
    with ``pin`` is found when a pin is given (a moment more, so a member posing as the console
    with the public pin does not hide the real one: the join tries each and refuses non-consoles).
    Malformed records are skipped (logged at DEBUG); at most MAX_CONSOLES records are kept and
    MAX_CONSOLES lookups run at once."""
    zc = _zeroconf_on(interface)
    found: dict[str, ConsoleAdvertisement] = {}
    hit = asyncio.Event()
    pending: set[asyncio.Task] = set()

    async def resolve(name: str) -> None:
        info = AsyncServiceInfo(CONSOLE_SERVICE_TYPE, name)
        if not await info.async_request(zc.zeroconf, 3000):
            return
        try:
            ad = ConsoleAdvertisement.from_service_info(info)
        except DiscoveryError as exc:
            log.debug("%s", exc)
            return
        if len(found) >= MAX_CONSOLES and ad.instance not in found:
            return
        found[ad.instance] = ad
        if pin is None or ad.ca_pin == pin.lower():
            hit.set()

    def on_change(zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is not ServiceStateChange.Removed and len(pending) < MAX_CONSOLES:
            start_task(resolve(name), name=f"deskfleet-resolve-console-{name}", logger=log, keep=pending)

    browser = None
    try:
        await _bounded(zc.zeroconf.async_wait_for_start(), 10.0, f"starting mDNS on {interface}")
        browser = AsyncServiceBrowser(zc.zeroconf, CONSOLE_SERVICE_TYPE, handlers=[on_change])
        with contextlib.suppress(TimeoutError):
            if pin is not None:
                await asyncio.wait_for(hit.wait(), timeout)
                await asyncio.sleep(min(PIN_GRACE_S, timeout))
            else:
                await asyncio.sleep(timeout)
    finally:
        if browser is not None:
            await browser.async_cancel()
        for task in list(pending):
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await zc.async_close()
    return tuple(found.values())
