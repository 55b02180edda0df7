"""A stage worker's connection to its next hop: the next stage, or the coordinator's return port.

It is dialled on first use (with retry, so the order in which a ring comes up does not matter),
watched so that a next stage that goes away is noticed at once (and Pinged while idle, so the
next stage's idle timeout never closes it between requests), and redialled once when a send
finds it gone (the next stage came back on its address). With TLS the listener must be the
node id the worker's peer policy names as next hop. Stateful and static workers share it.
"""

from __future__ import annotations

import asyncio
import logging
from ssl import SSLContext

from engine.suppress import logged_suppress
from engine.tasks import start_task
from engine.wire.address import Address
from engine.wire.format import COORDINATOR_STAGE, Role
from engine.wire.messages import Hello, Message
from engine.wire.transport import (
    PING_INTERVAL,
    Connection,
    ConnectionClosedError,
    PeerCheck,
    async_connect,
    async_hold,
)

log = logging.getLogger(__name__)


class Downstream:
    """The hop from stage ``stage_index`` to ``address`` (the return port when ``is_last``)."""

    def __init__(self, fingerprint: str, stage_index: int, is_last: bool, address: Address, *,
                 client_ssl: SSLContext | None = None, dial_deadline: float = 120.0,
                 peer_check: PeerCheck | None = None, ping_interval: float = PING_INTERVAL):
        self.fingerprint = fingerprint
        self.stage_index = stage_index
        self.is_last = is_last
        self.address = address
        self._client_ssl = client_ssl
        self._dial_deadline = dial_deadline
        self._peer_check = peer_check
        self._ping_interval = ping_interval
        self._conn: Connection | None = None
        self.bytes_sent = 0  # to the next hop, over every connection this side dialled
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None

    async def _connection(self) -> Connection:
        async with self._lock:
            if self._conn is None or self._conn.closed:
                next_index = COORDINATOR_STAGE if self.is_last else self.stage_index + 1
                hello = Hello(self.fingerprint, next_index, Role.STAGE)
                self._conn = await async_connect(self.address.host, self.address.port, hello,
                                                 ssl=self._client_ssl, deadline=self._dial_deadline,
                                                 peer_check=self._peer_check)
                self._watch = start_task(self._watch_connection(self._conn), logger=log,
                                         name=f"deskfleet-stage{self.stage_index}-next-hop-watch")
                log.info("stage %d connected to %s", self.stage_index, self.address)
            return self._conn

    async def _watch_connection(self, conn: Connection) -> None:
        """Learn at once when the next stage goes away (crash, kill, pause): the next frame then
        dials it afresh instead of vanishing into a dead socket."""
        await async_hold(conn, f"stage {self.stage_index} next hop", self._ping_interval)
        log.info("stage %d: the connection to %s is gone", self.stage_index, self.address)

    async def async_recheck(self) -> bool:
        """Drop the connection if the peer check no longer admits its listener (the policy
        changed); the next frame then dials afresh. True if it was dropped."""
        conn = self._conn
        if self._peer_check is None or conn is None or conn.closed:
            return False
        reason = self._peer_check(conn.peer_node_id)
        if reason is None:
            return False
        log.warning("stage %d: dropping the connection to %s: %s", self.stage_index, self.address, reason)
        with logged_suppress(log, f"stage {self.stage_index}: closing the dropped connection to {self.address}"):
            await conn.async_close()
        return True

    async def async_send(self, msg: Message) -> None:
        conn = await self._connection()
        try:
            await self._send(conn, msg)
        except (ConnectionClosedError, OSError):
            with logged_suppress(log, f"stage {self.stage_index}: closing the broken connection to {self.address}"):
                await conn.async_close()
            conn = await self._connection()  # the next stage came back on its address: one redial
            await self._send(conn, msg)

    async def _send(self, conn: Connection, msg: Message) -> None:
        before = conn.bytes_sent
        try:
            await conn.async_send(msg)
        finally:
            self.bytes_sent += conn.bytes_sent - before

    async def async_send_if_connected(self, msg: Message) -> bool:
        """Send ``msg`` only over a connection that is up now (never dial: cleanup must not wait
        for a next stage that is gone). True if it was sent."""
        conn = self._conn
        if conn is None or conn.closed:
            return False
        try:
            await self._send(conn, msg)
        except (ConnectionClosedError, OSError):
            return False
        return True

    async def async_close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._conn is not None:
            await self._conn.async_close()
