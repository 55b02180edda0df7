"""The Hello/HelloAck handshake as pure decisions: does this Hello (or HelloAck) match us?

No sockets: ``engine.wire.transport`` sends and reads the frames and acts on these answers. The
checks run in a fixed order (protocol version, model fingerprint, stage index, role) so the
first mismatch decides the Error code; docs/PROTOCOL.md describes the exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.wire.format import PROTOCOL_VERSION, ErrorCode, Role, WireError
from engine.wire.messages import Error, Hello, HelloAck


class HandshakeError(WireError):
    """The Hello/HelloAck exchange failed. ``field`` names what did not match
    (protocol_version, model_fingerprint, stage_index, role, or "peer": the certificate's node id
    is not the one expected, see ``engine.trust.peer_policy``), or is "frame" / "connection" when
    the exchange itself broke (wrong first frame, peer closed, TLS refused our certificate)."""

    def __init__(self, message: str, field: str, code: ErrorCode = ErrorCode.UNEXPECTED_FRAME):
        super().__init__(message)
        self.field = field
        self.code = code  # type: ignore[misc]  # instance value shadows the class default


@dataclass(frozen=True)
class LocalIdentity:
    """What a listening node serves; a Hello must match it field by field."""

    model_fingerprint: str
    stage_index: int
    accepted_roles: frozenset[Role] = frozenset(Role)
    protocol_version: int = PROTOCOL_VERSION


# The identity fields a Hello must match, in checking order: (field, refusal code, what to do).
_IDENTITY_CHECKS = (
    (
        "protocol_version",
        ErrorCode.PROTOCOL_VERSION_MISMATCH,
        "install the same Deskfleet release on every node",
    ),
    (
        "model_fingerprint",
        ErrorCode.MODEL_FINGERPRINT_MISMATCH,
        "this node holds another model or export; redistribute the shards",
    ),
    (
        "stage_index",
        ErrorCode.STAGE_INDEX_MISMATCH,
        "the dialer's placement is stale; refresh it from the console",
    ),
)
# The field each refusal code names; the role is checked after the identity fields.
_FIELD_OF_CODE = {
    **{code: field for field, code, _ in _IDENTITY_CHECKS},
    ErrorCode.ROLE_REFUSED: "role",
    ErrorCode.PEER_REFUSED: "peer",
}


def check_hello(hello: Hello, local: LocalIdentity) -> Error | None:
    """Return the refusal to send for ``hello``, or None to accept it.

    The code names the first mismatch in the order version, fingerprint, stage, role; the
    message lists every mismatching field with the value the dialer sent. It never states this
    node's own values: a refusal goes to whoever dialled, and an identity echoed back would
    tell a prober what to claim (the protocol version, public by nature, is the exception).
    """
    problems = [
        (code, f"{name} mismatch: you sent {getattr(hello, name)!r} ({hint})")
        for name, code, hint in _IDENTITY_CHECKS
        if getattr(hello, name) != getattr(local, name)
    ]  # fmt: skip
    if hello.role not in local.accepted_roles:
        text = f"role mismatch: a {hello.role.name} may not dial this port"
        problems.append((ErrorCode.ROLE_REFUSED, text))
    if not problems:
        return None
    return Error(problems[0][0], "handshake refused: " + "; ".join(text for _, text in problems))


def check_hello_ack(hello: Hello, ack: HelloAck) -> None:
    """Raise HandshakeError if the listener's HelloAck is not the identity ``hello`` asked for."""
    for name, code, _ in _IDENTITY_CHECKS:
        if getattr(hello, name) != getattr(ack, name):
            raise HandshakeError(
                f"{name} mismatch: asked for {getattr(hello, name)!r}, the listener acknowledged "
                f"{getattr(ack, name)!r}; it is not the node the placement names",
                name,
                code,
            )


def handshake_error_from(refusal: Error, *, sent: bool = False) -> HandshakeError:
    """The exception for a refusal (field named): received by the dialer, or ``sent`` by us."""
    field = _FIELD_OF_CODE.get(refusal.code, "frame")
    prefix = "we refused the dialer" if sent else "the peer refused our handshake"
    return HandshakeError(f"{prefix}: {refusal.message}", field, refusal.code)
