"""Link measurement through the agents' control API: round-trip time from small requests and
bandwidth from one larger download of ``/v1/link/echo``. The console measures console -> agent
itself and asks agents to measure agent -> agent (``POST /v1/link/measure``); placement turns the
results into one-way latencies (half the RTT).

The echo is the console's, and a measured agent admits another agent's probes only after the
console named it as a measure target (``POST /v1/link/expect``). The prober pins the peer: the
answer must come from an agent certificate, with the node id expected when one is given.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from ssl import SSLContext

import aiohttp

from engine.errors import DeskfleetError
from engine.trust.fleet_ca import Role
from engine.trust.tls_peer import (
    PeerCheckingConnector,
    PeerIdentityError,
    async_read_limited,
    expect_peer,
)

MAX_ECHO_BYTES = 64 << 20


class LinkError(DeskfleetError):
    """A link could not be measured (peer unreachable, refused, or too slow for the timeout)."""


@dataclass(frozen=True)
class LinkMeasurement:
    rtt_ms: float  # median of the small requests
    mbit_s: float  # payload bits over the large download's time (TLS included)

    @property
    def one_way_ms(self) -> float:
        return self.rtt_ms / 2


async def async_measure_link(base_url: str, ssl: SSLContext, *, samples: int = 5, nbytes: int = 1 << 20,
                             timeout: float = 30.0, node_id: str | None = None) -> LinkMeasurement:
    """Measure the link to the agent whose control API is at ``base_url`` (``https://host:port``);
    ``node_id``: the agent that must answer there (LinkError if another member does)."""
    rtts = []

    def too_big(message: str) -> LinkError:
        return LinkError(f"{message}; {base_url} is not a Deskfleet agent's echo")

    connector = PeerCheckingConnector(expect_peer(Role.AGENT, node_id, what=f"the agent at {base_url}"))
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            for _ in range(samples + 1):  # the first request pays for the TLS handshake: not counted
                t0 = time.perf_counter()
                async with session.get(f"{base_url}/v1/link/echo", params={"bytes": "1"}, ssl=ssl) as r:
                    r.raise_for_status()
                    await async_read_limited(r, 1, too_big)
                rtts.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            async with session.get(f"{base_url}/v1/link/echo", params={"bytes": str(nbytes)}, ssl=ssl) as r:
                r.raise_for_status()
                got = len(await async_read_limited(r, nbytes, too_big))
            elapsed = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError, OSError, PeerIdentityError) as exc:
        raise LinkError(f"cannot measure the link to {base_url}: {exc!r}") from exc
    rtt = statistics.median(rtts[1:])
    transfer_s = max(elapsed - rtt / 1e3, 1e-6)
    return LinkMeasurement(rtt_ms=rtt, mbit_s=got * 8 / transfer_s / 1e6)
