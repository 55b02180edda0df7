"""A user-space WAN emulator: a TCP proxy that delays, jitters and rate-limits one hop.

Office PCs talk over a LAN or a VPN, not loopback, so tests and benchmarks put a
:class:`WanProxy` on a hop of the ring (``worker k --next PROXY``, proxy target = worker k+1's
``--listen``; or between the coordinator and stage 0, or on the return path). It works below
the wire protocol and TLS, so the endpoints cannot tell it is there.

The model, per direction of each proxied connection, is a link of fixed bandwidth followed by a
propagation delay, like ``tc qdisc ... netem delay D jitter J rate R`` (netem itself needs root
and a kernel module, neither of which a test machine can count on):

* every chunk read gets a release time from :class:`LinkSchedule` (pure, unit-tested), and one
  writer task per direction sleeps until each chunk's time and writes it. Reading goes on
  meanwhile, so a whole delay's worth of chunks is in flight at once; a proxy that waited D per
  chunk would instead cap throughput at one chunk per D.
* chunks never overtake each other: TCP is a byte stream, so reordering would corrupt it.
* end of stream (FIN) travels the link like data, after everything queued ahead of it; a reset
  tears down both sides at once.
* the proxy adds no timeouts of its own beyond dialling: the endpoints' own deadlines apply, as
  they would over a real link.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import deque
from dataclasses import dataclass

from engine.errors import DeskfleetError
from engine.tasks import start_task
from engine.wire.address import Address
from engine.wire.transport import configure_socket

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 10  # largest read; with a bandwidth cap a chunk is store-and-forward
QUEUE_LIMIT_BYTES = 16 << 20  # per direction; beyond it the proxy stops reading (backpressure)
DIAL_TIMEOUT = 10.0  # seconds to keep redialling a target that is not listening yet
CLOSE_TIMEOUT = 2.0  # seconds for an orderly close before the socket is aborted
_FIRST_REDIAL_S, _MAX_REDIAL_S = 0.05, 1.0


class WanProxyError(DeskfleetError):
    """A WAN proxy was given a parameter it cannot emulate (negative delay, zero bandwidth, ...)."""


class LinkSchedule:
    """When each chunk of one direction leaves the emulated link. Pure: no clock, no sockets.

    A chunk arriving at ``now`` starts serialising once the link is free and is fully sent
    ``8 * nbytes / bandwidth`` seconds later; it then propagates for ``delay + jitter`` (jitter
    uniform in ±``jitter_s``, total clamped at zero) but is released no earlier than the chunk
    ahead of it, as TCP delivers in order. Payload bytes only: no header overhead is charged.
    """

    def __init__(self, delay_s: float, jitter_s: float = 0.0, bandwidth_bps: float | None = None,
                 rng: random.Random | None = None):
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.bandwidth_bps = bandwidth_bps
        self._rng = rng or random.Random()
        self._link_free_at = -math.inf
        self._last_release = -math.inf

    def release_at(self, now: float, nbytes: int) -> float:
        """Release time of a chunk of ``nbytes`` read at ``now`` (0 bytes: the end of stream)."""
        sent = now
        if self.bandwidth_bps is not None:
            sent = max(now, self._link_free_at) + 8 * nbytes / self.bandwidth_bps
            self._link_free_at = sent
        propagation = self.delay_s
        if self.jitter_s:
            propagation = max(0.0, propagation + self._rng.uniform(-self.jitter_s, self.jitter_s))
        self._last_release = max(sent + propagation, self._last_release)
        return self._last_release


@dataclass(frozen=True)
class DirectionStats:
    """Bytes and chunks delivered in one direction, summed over connections."""

    bytes: int = 0
    chunks: int = 0


@dataclass(frozen=True)
class WanStats:
    """A snapshot of :attr:`WanProxy.stats`: ``up`` is client→target, ``down`` target→client."""

    connections: int
    up: DirectionStats
    down: DirectionStats


class _Tally:
    __slots__ = ("bytes", "chunks")

    def __init__(self) -> None:
        self.bytes = 0
        self.chunks = 0


async def _async_sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    # Loop again rather than trust one sleep: a timer may fire a hair early, and the
    # emulated delay must be a lower bound that tests can assert.
    while (remaining := when - loop.time()) > 0:
        await asyncio.sleep(remaining)


class _Direction:
    """One direction of one proxied connection: a reader and a writer around a release queue."""

    def __init__(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, schedule: LinkSchedule,
                 tally: _Tally, queue_limit: int):
        self._src, self._dst = src, dst
        self._schedule = schedule
        self._tally = tally
        self._limit = queue_limit
        self._queue: deque[tuple[float, bytes]] = deque()  # (release time, data); b"" = EOF
        self._queued_bytes = 0
        self._changed = asyncio.Condition()

    async def async_read(self) -> None:
        """Timestamp and queue every chunk until the source's end of stream (or reset: raises)."""
        loop = asyncio.get_running_loop()
        while True:
            async with self._changed:
                # Wait for room *before* reading, so a chunk's timestamp is when it entered the
                # link; data held back meanwhile waits in the kernel and the sender slows down.
                await self._changed.wait_for(lambda: self._queued_bytes < self._limit)
            data = await self._src.read(CHUNK_BYTES)
            release = self._schedule.release_at(loop.time(), len(data))
            async with self._changed:
                self._queue.append((release, data))
                self._queued_bytes += len(data)
                self._changed.notify_all()
            if not data:
                return

    async def async_write(self) -> None:
        """Deliver each queued chunk at its release time; pass the end of stream on last."""
        loop = asyncio.get_running_loop()
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: bool(self._queue))
                release, data = self._queue.popleft()
                self._queued_bytes -= len(data)
                self._changed.notify_all()
            await _async_sleep_until(loop, release)
            if not data:
                if self._dst.can_write_eof():
                    self._dst.write_eof()  # half-close: the other direction may still carry data
                return
            self._dst.write(data)
            await self._dst.drain()  # a receiver that stops reading holds the link, as on a WAN
            self._tally.bytes += len(data)
            self._tally.chunks += 1


class WanProxy:
    """Accepts on ``listen``, dials ``target`` for each connection and emulates a WAN between.

    ``delay_ms`` is one way (a round trip through one proxy costs at least 2 × delay);
    ``jitter_ms`` spreads it uniformly by ± that much; ``bandwidth_mbit`` (10**6 bit/s) caps each
    direction separately, like a full-duplex link. ``seed`` makes the jitter of each connection
    reproducible. Use ``async with`` or async_start/async_close on the process's event loop.
    """

    def __init__(self, listen: Address, target: Address, *, delay_ms: float, jitter_ms: float = 0,
                 bandwidth_mbit: float | None = None, seed: int | None = None,
                 queue_limit_bytes: int = QUEUE_LIMIT_BYTES, dial_timeout: float = DIAL_TIMEOUT):
        _check("delay_ms", delay_ms, "a one-way delay in milliseconds, 0 or more")
        _check("jitter_ms", jitter_ms, "a jitter in milliseconds, 0 or more")
        if bandwidth_mbit is not None:
            _check("bandwidth_mbit", bandwidth_mbit, "a rate in Mbit/s above 0, or None for no cap",
                   positive=True)
        _check("queue_limit_bytes", queue_limit_bytes, "a byte count above 0", positive=True)
        _check("dial_timeout", dial_timeout, "a time in seconds above 0", positive=True)
        self.listen = listen
        self.target = target
        self.delay_ms, self.jitter_ms, self.bandwidth_mbit = delay_ms, jitter_ms, bandwidth_mbit
        self.seed = seed
        self._queue_limit = int(queue_limit_bytes)
        self._dial_timeout = dial_timeout
        self._server: asyncio.Server | None = None
        self._sessions: set[asyncio.Task[None]] = set()
        self._connections = 0
        self._up, self._down = _Tally(), _Tally()
        self._warned = False

    @property
    def address(self) -> Address:
        """The bound address (the real port when ``listen`` asked for port 0)."""
        if self._server is None:
            raise RuntimeError("WanProxy.address is known only after async_start()")
        host, port = self._server.sockets[0].getsockname()[:2]
        return Address(host, port)

    @property
    def stats(self) -> WanStats:
        """Connections accepted and bytes/chunks delivered each way so far."""
        return WanStats(self._connections, DirectionStats(self._up.bytes, self._up.chunks),
                        DirectionStats(self._down.bytes, self._down.chunks))

    async def async_start(self) -> Address:
        """Start listening; returns the bound address. The target need not be up yet."""
        self._server = await asyncio.start_server(self._on_accept, self.listen.host, self.listen.port)
        log.info("wan proxy %s -> %s: delay %g ms, jitter %g ms, bandwidth %s", self.address,
                 self.target, self.delay_ms, self.jitter_ms,
                 "unlimited" if self.bandwidth_mbit is None else f"{self.bandwidth_mbit:g} Mbit/s")
        return self.address

    async def async_close(self) -> None:
        """Stop listening and close every proxied connection; queued data is dropped."""
        if self._server is not None:
            self._server.close()
        for task in list(self._sessions):
            task.cancel()
        await asyncio.gather(*self._sessions, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> WanProxy:
        await self.async_start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.async_close()

    def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Our own task rather than asyncio's, so async_close can cancel and await it.
        start_task(self._async_session(reader, writer), name="deskfleet-wan-session", logger=log, keep=self._sessions)

    def _schedule(self, index: int, direction: str) -> LinkSchedule:
        # Seed per connection and direction so jitter does not depend on how reads interleave.
        rng = random.Random(f"{self.seed}:{index}:{direction}") if self.seed is not None else None
        bandwidth = None if self.bandwidth_mbit is None else self.bandwidth_mbit * 1e6
        return LinkSchedule(self.delay_ms / 1000, self.jitter_ms / 1000, bandwidth, rng)

    async def _async_session(self, client_reader: asyncio.StreamReader,
                             client_writer: asyncio.StreamWriter) -> None:
        """Proxy one connection until both directions have ended or either side reset."""
        target_writer: asyncio.StreamWriter | None = None
        broken = True
        try:
            target = await self._async_dial()
            if target is None:
                return
            target_reader, target_writer = target
            configure_socket(client_writer.get_extra_info("socket"))
            index = self._connections
            self._connections += 1
            up = _Direction(client_reader, target_writer, self._schedule(index, "up"), self._up,
                            self._queue_limit)
            down = _Direction(target_reader, client_writer, self._schedule(index, "down"), self._down,
                              self._queue_limit)
            tasks = [asyncio.create_task(step()) for step in
                     (up.async_read, up.async_write, down.async_read, down.async_write)]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            for exc in errors:
                log.debug("wan proxy %s: connection ended by %r", self.target, exc)
            broken = bool(errors)
        except asyncio.CancelledError:
            pass  # async_close: nobody awaits this task's result, so end it quietly
        finally:
            for writer in (client_writer, target_writer):
                if writer is not None:
                    await _async_close_writer(writer, abort=broken)

    async def _async_dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Connect to the target, retrying while it is not listening yet (None: gave up)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._dial_timeout
        pause = _FIRST_REDIAL_S
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    reader, writer = await asyncio.open_connection(self.target.host, self.target.port)
                configure_socket(writer.get_extra_info("socket"))
                return reader, writer
            except OSError as exc:  # includes TimeoutError and ConnectionRefusedError
                if loop.time() + pause >= deadline:
                    self._warn(f"could not reach the target {self.target} within {self._dial_timeout:g} s "
                               f"({exc}); resetting the client connection. Start the target first "
                               "or check its address")
                    return None
            await asyncio.sleep(pause)  # backoff between attempts, not synchronisation
            pause = min(2 * pause, _MAX_REDIAL_S)

    def _warn(self, text: str) -> None:
        # A client that redials forever would flood the log: WARNING once, then DEBUG.
        log.log(logging.DEBUG if self._warned else logging.WARNING, "wan proxy: %s", text)
        self._warned = True


async def _async_close_writer(writer: asyncio.StreamWriter, *, abort: bool) -> None:
    """Close one side: an orderly FIN normally, a reset (RST) to pass a reset on."""
    if abort:
        writer.transport.abort()
        return
    writer.close()
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await writer.wait_closed()
    except OSError:  # includes TimeoutError: the peer is gone or stuck; drop what is left
        writer.transport.abort()


def _check(name: str, value: float, meaning: str, *, positive: bool = False) -> None:
    ok = isinstance(value, int | float) and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise WanProxyError(f"WAN proxy {name}={value!r} is not valid: it must be {meaning}")
