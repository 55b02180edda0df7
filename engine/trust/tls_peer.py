"""Who is on the other end of an HTTPS connection, checked on every connection, and answers read
with a size limit.

Every member's certificate chains to the fleet CA, so a verified TLS handshake says only "some
member". :class:`PeerCheckingConnector` is an aiohttp connector that runs a check on the peer's
certificate (DER) right after each new TLS handshake and before the request is written, so a
join token or a console command never reaches a peer that is not the one expected; it also
remembers the node id it last saw (``seen``), for callers that learn an id from the certificate
rather than from what the peer writes in its answer.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp

from engine.errors import TrustError
from engine.trust.fleet_ca import Role, peer_node_id, peer_role


class PeerIdentityError(TrustError):
    """The peer of a TLS connection is a fleet member, but not the one (node id) or not the kind
    (role) the caller expected: nothing was sent to it. ``node_id`` is the peer's id, ``role``
    its certificate's role."""

    def __init__(self, message: str, node_id: str | None = None, role: Role | None = None) -> None:
        super().__init__(message)
        self.node_id = node_id
        self.role = role


def expect_peer(role: Role, node_id: str | None = None, *, deny: Callable[[str], bool] = lambda n: False,
                what: str = "the peer") -> Callable[[bytes], None]:
    """A certificate check: the peer must have ``role`` and, if given, node id ``node_id``, and
    must not be denied; raises PeerIdentityError naming the peer (never this node)."""

    def check(der: bytes) -> None:
        got, got_role = peer_node_id(der), peer_role(der)
        if deny(got):
            raise PeerIdentityError(f"{what} answered as member {got[:16]}…, whose certificate the console "
                                    "revoked", got, got_role)
        if got_role is not role:
            raise PeerIdentityError(f"{what} answered with a {got_role or 'role-less'} certificate "
                                    f"({got[:16]}…), not a {role} one: another fleet member is posing as it",
                                    got, got_role)
        if node_id is not None and got != node_id:
            raise PeerIdentityError(f"{what} answered as member {got[:16]}…, not as {node_id[:16]}…: the "
                                    "address now belongs to another member, or someone is posing as it",
                                    got, got_role)

    return check


class PeerCheckingConnector(aiohttp.TCPConnector):
    """A TCPConnector that calls ``check(peer_cert_der)`` after every new TLS connection (before
    any request bytes are written) and closes the connection if it raises."""

    def __init__(self, check: Callable[[bytes], None], **kwargs) -> None:
        super().__init__(**kwargs)
        self._check = check
        self.seen: str | None = None

    async def _create_connection(self, req, traces, timeout):  # aiohttp's hook for a new connection
        proto = await super()._create_connection(req, traces, timeout)
        transport = proto.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        try:
            if not der:
                raise PeerIdentityError("the peer presented no certificate over TLS")
            self.seen = peer_node_id(der)
            self._check(der)
        except BaseException:
            proto.close()
            raise
        return proto


async def async_read_limited(resp: aiohttp.ClientResponse, limit: int,
                             error: Callable[[str], Exception]) -> bytes:
    """The body of ``resp``, or ``error(message)`` raised as soon as it passes ``limit`` bytes."""
    data = bytearray()
    async for chunk in resp.content.iter_chunked(8192):
        data.extend(chunk)
        if len(data) > limit:
            raise error(f"the answer from {resp.url.host} exceeds {limit} bytes")
    return bytes(data)
