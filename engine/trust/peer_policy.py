"""Who may sit on each end of a data-plane connection: pure decisions over node ids.

Every member's certificate chains to the fleet CA, so TLS alone says only "some member". A
stage must take steps only from its upstream neighbour (stage 0: the coordinator) and hand
them only to its next hop (the last stage: the coordinator's return port); the coordinator's
return port must take replies only from its ring's last stage. A :class:`PeerPolicy` holds
those expectations as node ids (``engine.trust.fleet_ca.peer_node_id``: sha256 of the peer's
certificate), plus a deny set of revoked node ids that is refused whatever else it says.

No sockets here: ``engine.wire.transport`` asks :meth:`PeerPolicy.refuse_upstream` /
:meth:`PeerPolicy.refuse_next` after the TLS handshake and acts on the answer. Refusal texts
name the *peer's* id only, never this node's identity. docs/PROTOCOL.md ("Peer identity")
describes the JSON that :func:`parse_policy_update` reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.errors import DeskfleetError

NODE_ID = re.compile(r"[0-9a-f]{64}")
# The keys a policy update may carry; the worker's first stdin line also carries its credentials.
POLICY_KEYS = frozenset({"expect_upstream", "expect_next", "deny"})
CREDENTIAL_KEYS = frozenset({"ca_pem", "cert_pem", "key_pem"})
MAX_IDS = 1024  # a ring has a handful of stages; a deny list of a whole office still fits


class PeerPolicyError(DeskfleetError):
    """A peer-policy update (the ``--tls-stdin`` JSON, a later stdin line, or a CLI flag) is
    malformed: a key this version does not know, a node id that is not 64 hex digits, a value
    of the wrong type. The policy in force stays as it was."""


def short(node_id: str | None) -> str:
    """A node id as logs and refusals show it (enough to tell members apart)."""
    return "(no certificate)" if node_id is None else node_id[:12] + "…"


@dataclass(frozen=True)
class PeerPolicy:
    """The node ids one data-plane endpoint accepts.

    ``upstream``: who may dial our listener (a stage's upstream neighbour, or for the
    coordinator's return port the ring's last stage); several during a failover move.
    ``next``: who must answer when we dial our next hop (None: nobody is expected yet, so
    dialling is refused). ``deny``: revoked node ids, refused on both sides always.
    """

    upstream: frozenset[str] = frozenset()
    next: str | None = None
    deny: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for node_id in (*self.upstream, *self.deny, *((self.next,) if self.next else ())):
            if not isinstance(node_id, str) or not NODE_ID.fullmatch(node_id):
                raise PeerPolicyError(f"{node_id!r} is not a node id (64 lowercase hex digits: sha256 of "
                                      "the member's certificate, as the console lists it)")

    @classmethod
    def of(cls, upstream: Iterable[str] = (), next: str | None = None, deny: Iterable[str] = ()) -> PeerPolicy:
        """A policy from any iterables, node ids normalised to lower case."""
        return cls(frozenset(i.lower() for i in upstream), next.lower() if next else None,
                   frozenset(i.lower() for i in deny))

    def refuse_upstream(self, node_id: str | None) -> str | None:
        """Why a dialer with ``node_id`` may not use our listener, or None to admit it."""
        if node_id is None:
            return "the dialer presented no certificate"
        if node_id in self.deny:
            return f"member {short(node_id)} is revoked"
        if not self.upstream:
            return ("no upstream peer is expected here yet; the console sends the expected node ids "
                    "with the assignment")
        if node_id not in self.upstream:
            return (f"member {short(node_id)} is not the upstream peer the placement names for this "
                    "port; refresh the placement from the console")
        return None

    def refuse_next(self, node_id: str | None) -> str | None:
        """Why the listener we dialled (``node_id``) is not our next hop, or None if it is."""
        if node_id is None:
            return "the next hop presented no certificate"
        if node_id in self.deny:
            return f"the next hop {short(node_id)} is revoked"
        if self.next is None:
            return "no next-hop peer is expected yet; the console sends it with the assignment"
        if node_id != self.next:
            return (f"the next hop answered as member {short(node_id)}, not the one the placement names "
                    f"({short(self.next)}); its address may have been taken over")
        return None


def _ids(value: object, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PeerPolicyError(f"{key} must be a list of node ids (strings), got {type(value).__name__}")
    if len(value) > MAX_IDS:
        raise PeerPolicyError(f"{key} lists {len(value)} node ids; at most {MAX_IDS} are accepted")
    return value


def parse_policy_update(blob: Mapping[str, object], *, allow_credentials: bool = False) -> PeerPolicy:
    """The policy a JSON object describes: ``{"expect_upstream": [...], "expect_next": "...",
    "deny": [...]}``, every key optional (absent: empty / None). Each update is a whole policy:
    it replaces the one in force, it is not merged with it.

    ``allow_credentials`` admits the ``ca_pem``/``cert_pem``/``key_pem`` keys of the worker's
    first ``--tls-stdin`` line (ignored here). Raises PeerPolicyError for anything else.
    """
    if not isinstance(blob, Mapping):
        raise PeerPolicyError(f"a peer-policy update must be a JSON object, got {type(blob).__name__}")
    allowed = POLICY_KEYS | (CREDENTIAL_KEYS if allow_credentials else frozenset())
    unknown = sorted(set(blob) - allowed)
    if unknown:
        raise PeerPolicyError(f"unknown key(s) {', '.join(map(repr, unknown))} in a peer-policy update; "
                              f"the keys are {', '.join(sorted(POLICY_KEYS))}")
    upstream = _ids(blob.get("expect_upstream", []), "expect_upstream")
    deny = _ids(blob.get("deny", []), "deny")
    next_id = blob.get("expect_next")
    if next_id is not None and not isinstance(next_id, str):
        raise PeerPolicyError(f"expect_next must be a node id (string) or null, got {type(next_id).__name__}")
    return PeerPolicy.of(upstream, next_id, deny)
