"""mDNS/DNS-SD discovery: agents advertise ``_deskfleet._tcp``, the console browses for them.

A peer's record is hostile until `Advertisement.from_service_info` has checked it: a malformed
peer is ignored by the `Browser` (logged once at WARNING, then at DEBUG), never allowed to crash
it, and a known peer whose record turns malformed is dropped rather than kept with stale data.

Zeroconf is always bound to one explicit IPv4 interface address (``interfaces=[addr]``): nothing
here ever picks "all interfaces", so a test bound to 127.0.0.1 never sends mDNS onto the real
network, and several agents can run side by side on one machine, each bound to its own address.
Everything runs on the process's one asyncio loop (hence the ``async_`` prefix); every wait is
bounded and raises `DiscoveryError`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from zeroconf import IPVersion, NonUniqueNameException, ServiceInfo, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from engine.discovery.advertisement import (
    MAX_TXT_BYTES,
    SERVICE_TYPE,
    TXT_KEYS,
    Advertisement,
    AgentState,
    instance_name,
    new_instance_name,
)
from engine.errors import DiscoveryError
from engine.tasks import start_task

__all__ = ["MAX_TXT_BYTES", "RECORD_TTL_S", "SERVICE_TYPE", "TXT_KEYS", "Advertisement", "Advertiser",
           "AgentState", "Browser", "Peer", "instance_name", "new_instance_name"]

log = logging.getLogger(__name__)
_SUFFIX = "." + SERVICE_TYPE
RECORD_TTL_S = 120


def _zeroconf_on(interface: str) -> AsyncZeroconf:
    """Zeroconf bound to exactly one IPv4 interface address (never all interfaces)."""
    address = _check_interface(interface)
    try:
        return AsyncZeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
    except OSError as e:
        raise DiscoveryError(f"cannot use mDNS on interface {interface}: {e}; "
                             "pass the IPv4 address of one of this machine's interfaces") from e


def _check_interface(interface: object) -> str:
    try:
        address = ipaddress.IPv4Address(interface)
    except (ipaddress.AddressValueError, ValueError, TypeError):
        raise DiscoveryError(f"{interface!r} is not an IPv4 interface address; discovery binds "
                             "to one explicit interface, e.g. 192.168.1.20 or 127.0.0.1") from None
    if address.is_unspecified or address.is_multicast:
        raise DiscoveryError(f"{interface} would bind every interface (or none); "
                             "pass one interface's own address")
    return str(address)


async def _bounded(awaitable, timeout: float, what: str):
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise DiscoveryError(f"{what} took longer than {timeout:g} s; is the interface up "
                             "and multicast allowed on it?") from None


class RecordPublisher:
    """One mDNS record published on one interface until closed (goodbye packets on close); every
    wait bounded by ``timeout``. ``allow_name_change``: two publishers of one name (a restart
    racing its own goodbye) both get one."""

    def __init__(self, interface: str, *, timeout: float = 10.0) -> None:
        self.interface = _check_interface(interface)
        self.timeout = timeout
        self._zc: AsyncZeroconf | None = None
        self._info: ServiceInfo | None = None

    @property
    def published(self) -> bool:
        return self._zc is not None

    async def async_publish(self, info: ServiceInfo, what: str) -> None:
        if self._zc is not None:
            raise RuntimeError(f"{what} is already published")
        zc = _zeroconf_on(self.interface)
        try:
            announced = await _bounded(zc.async_register_service(info, allow_name_change=True), self.timeout,
                                       f"probing for {what} on {self.interface}")
            await _bounded(announced, self.timeout, f"announcing {what} on {self.interface}")
        except BaseException:
            await zc.async_close()
            raise
        self._zc, self._info = zc, info

    async def async_close(self) -> None:
        zc, info, self._zc, self._info = self._zc, self._info, None, None
        if zc is None:
            return
        try:
            if info is not None:
                await _bounded(await zc.async_unregister_service(info), self.timeout, "sending goodbye packets")
        finally:
            await zc.async_close()


class Advertiser:
    """Publishes one agent's `Advertisement` on one interface, re-announces it on change and
    withdraws it (goodbye packets) on close."""

    def __init__(self, interface: str, *, timeout: float = 10.0) -> None:
        self.interface = _check_interface(interface)
        self.timeout = timeout
        self.advertisement: Advertisement | None = None
        self._zc: AsyncZeroconf | None = None
        self._info: ServiceInfo | None = None

    def _info_for(self, ad: Advertisement) -> ServiceInfo:
        # The SRV target (host name) is the service name itself: unique per agent even when
        # several agents share one machine, unlike the host's own name. Every record lives
        # RECORD_TTL_S rather than mDNS's 75 min default, so an agent that died without goodbye
        # packets leaves the browsers within about two minutes.
        return ServiceInfo(SERVICE_TYPE, ad.service_name, port=ad.control_port,
                           properties=ad.to_properties(), parsed_addresses=list(ad.addresses),
                           server=ad.service_name, host_ttl=RECORD_TTL_S, other_ttl=RECORD_TTL_S)

    def _complete(self, ad: Advertisement) -> Advertisement:
        # An agent that does not list its addresses is reachable on the one it advertises on.
        return ad if ad.addresses else replace(ad, addresses=(self.interface,))

    async def async_start(self, ad: Advertisement) -> Advertisement:
        """Probe for the name, then announce. Returns the advertisement as published (its
        addresses filled in with the interface when empty)."""
        if self._zc is not None:
            raise RuntimeError("Advertiser already started; use async_update")
        ad = self._complete(ad)
        self._zc = _zeroconf_on(self.interface)
        info = self._info_for(ad)
        try:
            announced = await _bounded(self._zc.async_register_service(info), self.timeout,
                                       f"probing for {ad.instance!r} on {self.interface}")
            await _bounded(announced, self.timeout, f"announcing {ad.instance!r}")
        except NonUniqueNameException:
            await self._zc.async_close()
            self._zc = None
            raise DiscoveryError(f"another service already advertises {ad.instance!r} on "
                                 f"{self.interface}; start with a new instance name") from None
        except BaseException:
            await self._zc.async_close()
            self._zc = None
            raise
        self._info, self.advertisement = info, ad
        return ad

    async def async_update(self, ad: Advertisement) -> Advertisement:
        """Re-announce when anything changed (state, devices, fleet...); a no-op otherwise.
        The instance name is the service's identity and cannot change here."""
        if self._zc is None or self.advertisement is None:
            raise RuntimeError("Advertiser not started")
        if ad.instance != self.advertisement.instance:
            raise ValueError("the instance name cannot change while advertising; "
                             "close this Advertiser and start a new one")
        ad = self._complete(ad)
        if ad == self.advertisement:
            return ad
        info = self._info_for(ad)
        announced = await self._zc.async_update_service(info)
        await _bounded(announced, self.timeout, f"re-announcing {ad.instance!r}")
        self._info, self.advertisement = info, ad
        return ad

    async def async_close(self) -> None:
        """Withdraw the service (goodbye packets, so browsers drop it at once) and close."""
        zc, info, self._zc, self._info = self._zc, self._info, None, None
        if zc is None:
            return
        try:
            if info is not None:
                goodbyes = await zc.async_unregister_service(info)
                await _bounded(goodbyes, self.timeout, "sending goodbye packets")
        finally:
            await zc.async_close()


@dataclass(frozen=True)
class Peer:
    """One agent as the browser last saw it. ``last_seen`` (`time.monotonic()`) is when its
    record last arrived new or changed; an unchanged refresh does not move it. Liveness is the
    record's TTL (`RECORD_TTL_S`): a silent agent is removed when its records expire."""

    advertisement: Advertisement
    last_seen: float


MAX_PENDING_RESOLVES = 32  # record lookups in flight: a flood of new names waits its turn, or is dropped
MAX_PEERS = 512  # agents tracked on one interface: an office, with room; a flood of names stops here


class Browser:
    """Keeps the set of valid agents advertising on one interface.

    Bounded against a flood of forged names: at most MAX_PENDING_RESOLVES lookups in flight and
    MAX_PEERS peers tracked; names past those are ignored (logged once) until others leave.

    ``on_change(peers)`` is called on the loop with a fresh ``{instance: Peer}`` snapshot when
    a peer appears, changes its advertisement, or leaves (goodbye, TTL expiry, or turning
    malformed). An exception in the callback is logged, never propagated into zeroconf.
    """

    def __init__(self, interface: str,
                 on_change: Callable[[dict[str, Peer]], None] | None = None, *,
                 resolve_timeout: float = 3.0) -> None:
        self.interface = _check_interface(interface)
        self.on_change = on_change
        self.resolve_timeout = resolve_timeout
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._peers: dict[str, Peer] = {}
        self._pending: dict[str, asyncio.Task] = {}
        self._warned: set[str] = set()

    async def async_start(self) -> None:
        """Bind to the interface and start browsing (queries go out at once)."""
        if self._zc is not None:
            raise RuntimeError("Browser already started")
        self._zc = _zeroconf_on(self.interface)
        await _bounded(self._zc.zeroconf.async_wait_for_start(), 10.0,
                       f"starting mDNS on {self.interface}")
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE,
                                            handlers=[self._on_service_state_change])

    def peers(self) -> dict[str, Peer]:
        """The valid peers now, keyed by instance name (a copy)."""
        return dict(self._peers)

    def _on_service_state_change(self, zeroconf, service_type: str, name: str,
                                 state_change: ServiceStateChange) -> None:
        # Zeroconf calls handlers with these exact keyword names, on the loop.
        key = name.lower()
        old = self._pending.pop(key, None)
        if old is not None:
            old.cancel()
        if state_change is ServiceStateChange.Removed:
            self._drop(name)
        elif len(self._pending) >= MAX_PENDING_RESOLVES or (
                len(self._peers) >= MAX_PEERS and not self._tracks(name)):
            self._complain("(flood)", f"ignoring {name!r}: {len(self._pending)} records are being resolved "
                                      f"and {len(self._peers)} agents tracked already (limits "
                                      f"{MAX_PENDING_RESOLVES}, {MAX_PEERS})")
        else:
            task = start_task(self._resolve(name), name=f"deskfleet-resolve-{key}", logger=log, level=logging.ERROR)
            self._pending[key] = task
            task.add_done_callback(lambda t: self._forget(key, t))

    def _forget(self, key: str, task: asyncio.Task) -> None:
        if self._pending.get(key) is task:  # its failure, if any, start_task logged
            del self._pending[key]

    async def _resolve(self, name: str) -> None:
        assert self._zc is not None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._zc.zeroconf, int(self.resolve_timeout * 1000)):
            self._complain(name, f"{name!r} did not answer with a full record within "
                                 f"{self.resolve_timeout:g} s")
            return
        try:
            ad = Advertisement.from_service_info(info)
        except DiscoveryError as e:
            self._complain(name, f"ignoring {name!r}: {e}")
            self._drop(name)
            return
        self._warned.discard(name.lower())
        changed = ad != (self._peers[ad.instance].advertisement if ad.instance in self._peers else None)
        if ad.instance not in self._peers and len(self._peers) >= MAX_PEERS:
            self._complain("(flood)", f"ignoring {name!r}: {MAX_PEERS} agents are tracked already")
            return
        self._peers[ad.instance] = Peer(ad, time.monotonic())
        if changed:
            self._notify()

    def _tracks(self, name: str) -> bool:
        instance = name[: -len(_SUFFIX)] if name.lower().endswith(_SUFFIX.lower()) else name
        return instance in self._peers

    def _complain(self, name: str, message: str) -> None:
        # Once at WARNING per peer, then DEBUG: a broken peer re-announces every few seconds.
        key = name.lower()
        if len(self._warned) > 4 * MAX_PEERS:  # a flood of broken names must not grow this for ever
            self._warned.clear()
        log.log(logging.DEBUG if key in self._warned else logging.WARNING, "%s", message)
        self._warned.add(key)

    def _drop(self, name: str) -> None:
        instance = name[: -len(_SUFFIX)] if name.lower().endswith(_SUFFIX.lower()) else name
        if self._peers.pop(instance, None) is not None:
            self._notify()

    def _notify(self) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(self.peers())
        except Exception:
            log.exception("discovery on_change callback failed")

    async def async_close(self) -> None:
        """Stop browsing, cancel pending resolutions, close zeroconf."""
        zc, browser, self._zc, self._browser = self._zc, self._browser, None, None
        if browser is not None:
            await browser.async_cancel()
        pending, self._pending = list(self._pending.values()), {}
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if zc is not None:
            await zc.async_close()
