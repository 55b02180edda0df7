"""Connection caps for the fleet's aiohttp listeners: per peer IP and in total.

aiohttp bounds bodies and headers but not how many connections a listener holds, so one host
could open sockets until the process runs out of file descriptors. :class:`LimitedAppRunner` is
an ``aiohttp.web.AppRunner`` whose protocol factory counts connections by peer IP: past a cap a
new connection is closed at once (before any request is read), and connections already held are
untouched. The defaults are far above what an office fleet uses (one console, a few dozen PCs,
each with a handful of keep-alive connections); the API's ``max_concurrent`` still bounds the
requests that run. Used by the enrollment endpoint, the hub, the agent's control API and the
OpenAI API. Over TLS the count applies once the handshake is done (asyncio hands the connection
to the protocol then); the handshake itself is bounded by asyncio's timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

log = logging.getLogger(__name__)

MAX_PER_IP = 32
MAX_TOTAL = 256


@dataclass(frozen=True)
class ConnectionLimits:
    """At most ``per_ip`` connections from one peer address and ``total`` in all."""

    per_ip: int = MAX_PER_IP
    total: int = MAX_TOTAL

    def __post_init__(self) -> None:
        if not 0 < self.per_ip <= self.total:
            raise ValueError(f"connection limits need 0 < per_ip ({self.per_ip}) <= total ({self.total})")


DEFAULT_LIMITS = ConnectionLimits()


class ConnectionCounter:
    """The policy: who holds how many connections; ``refused`` counts the ones turned away."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.by_ip: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.refused = 0

    def admit(self, ip: str) -> bool:
        if self.total >= self.limits.total or self.by_ip[ip] >= self.limits.per_ip:
            self.refused += 1
            return False
        self.by_ip[ip] += 1
        self.total += 1
        return True

    def release(self, ip: str) -> None:
        self.total -= 1
        self.by_ip[ip] -= 1
        if self.by_ip[ip] <= 0:
            del self.by_ip[ip]


class _Counted(asyncio.Protocol):
    """aiohttp's request handler behind a gate: admitted connections pass straight through."""

    def __init__(self, inner: asyncio.Protocol, counter: ConnectionCounter, what: str) -> None:
        self._inner = inner
        self._counter = counter
        self._what = what
        self._ip: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._counter.admit(ip):
            if self._counter.refused in (1, 10, 100) or self._counter.refused % 1000 == 0:
                log.warning("%s: connection from %s refused (cap %d per address, %d in all; %d refused so far)",
                            self._what, ip, self._counter.limits.per_ip, self._counter.limits.total,
                            self._counter.refused)
            cast(asyncio.Transport, transport).abort()  # a listening socket's transports are Transports
            return
        self._ip = ip
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ip is None:
            return  # refused: the handler never saw it
        self._counter.release(self._ip)
        self._ip = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._ip is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._ip is not None else None

    def pause_writing(self) -> None:
        if self._ip is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._ip is not None:
            self._inner.resume_writing()


class LimitedAppRunner(web.AppRunner):
    """An AppRunner whose sites accept at most ``limits`` connections (see the module docstring)."""

    def __init__(self, app: web.Application, *, limits: ConnectionLimits = DEFAULT_LIMITS,
                 what: str = "listener", **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.connections = ConnectionCounter(limits)
        self._what = what

    # aiohttp annotates ``server`` as its Server, but TCPSite only hands it to create_server as a
    # protocol factory, which is what this returns.
    @property
    def server(self) -> Callable[[], asyncio.Protocol] | None:  # type: ignore[override]
        inner = super().server
        if inner is None:
            return None
        counter, what = self.connections, self._what
        return lambda: _Counted(inner(), counter, what)
