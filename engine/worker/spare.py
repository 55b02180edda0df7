"""A warm spare: a stage worker with its shard opened, converted and compiled, not yet in the ring.

``deskfleet worker --spare`` does everything a worker does before it listens (a paged one also
runs a throw-away prefill chunk and decode step: :func:`warm_up`), prints
:data:`SPARE_PREFIX` and waits. One :class:`Activation` line on stdin puts it in the ring: it
binds the listen address (the one a crashed worker just left, or a standby's own), dials the
next hop, takes the peer policy the line carries, then prints the usual ready line. So recovery
from a lost worker is "point the ring at the spare" (tens of milliseconds), not "start Python,
import OpenVINO, read and compile the shard" (seconds).

Every worker also prints one :data:`TIMING_PREFIX` line before its ready line: wall-clock times
of entering the serve loop (after Python started and OpenVINO was imported), of the shard being
open and compiled, of activation (a spare) and of listening. The supervising agent keeps them so
a failover's breakdown can say where the time went.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import DeskfleetError
from engine.paged.stage import PagedStage
from engine.trust.peer_policy import PeerPolicy, PeerPolicyError, parse_policy_update
from engine.wire.address import Address
from engine.wire.step_plan import SCRATCH_BLOCKS, PlanRow, StepPlan, blocks_needed

SPARE_PREFIX = "deskfleet-spare "  # once, when a spare's shard is compiled: {"stage": N, "opened_s": ...}
TIMING_PREFIX = "deskfleet-timing "  # once, just before the ready line: wall-clock times (see module doc)
ACTIVATE_KEY = "activate"
WARM_UP_TOKENS = 256  # a paged spare's warm-up prefill: the console's token budget (a replay's chunk)


class ActivationError(DeskfleetError):
    """An activation line on a spare's stdin is malformed (the spare keeps waiting for a good one)."""


@dataclass(frozen=True)
class Activation:
    """Where a spare serves once activated, and (optionally) the peer policy it serves under."""

    listen: Address
    next_hop: Address
    peers: PeerPolicy | None = None

    def to_line(self, policy: Mapping[str, Any] | None = None) -> bytes:
        """The stdin line (``policy``: the peer-policy JSON keys, sent with it)."""
        blob: dict[str, Any] = {ACTIVATE_KEY: {"listen": str(self.listen), "next": str(self.next_hop)}}
        blob.update(policy or {})
        return json.dumps(blob).encode() + b"\n"


def is_activation(blob: object) -> bool:
    return isinstance(blob, dict) and ACTIVATE_KEY in blob


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"; False for anything reachable from the network."""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    return host == "localhost"


def parse_activation(blob: Mapping[str, Any], *, tls: bool = True) -> Activation:
    """The :class:`Activation` of one decoded stdin line; ActivationError saying what is wrong.

    ``tls=False`` (a spare started without ``--tls-stdin``) refuses a listen or next-hop address
    off loopback, as ``deskfleet worker`` refuses it at start: a plaintext data plane on the
    network would let any host inject or read steps."""
    where = blob.get(ACTIVATE_KEY)
    if not isinstance(where, Mapping) or set(where) != {"listen", "next"}:
        raise ActivationError('an activation must be {"activate": {"listen": "HOST:PORT", "next": "HOST:PORT"}, '
                              f"...peer policy}}; got {where!r}")
    try:
        listen, next_hop = Address.parse(str(where["listen"])), Address.parse(str(where["next"]))
    except DeskfleetError as exc:
        raise ActivationError(f"an activation's address is not HOST:PORT: {exc}") from exc
    if not tls:
        for what, address in (("listen", listen), ("next", next_hop)):
            if not is_loopback_host(address.host):
                raise ActivationError(f"an activation's {what} address {address} would carry the data plane across "
                                      "the network without TLS, where any host could inject or read steps; this "
                                      "spare has no credentials (start it with --tls-stdin), or use 127.0.0.1")
    rest = {k: v for k, v in blob.items() if k != ACTIVATE_KEY}
    peers = None
    if rest:
        try:
            peers = parse_policy_update(rest)
        except PeerPolicyError as exc:
            raise ActivationError(f"an activation's peer policy is invalid: {exc}") from exc
    return Activation(listen, next_hop, peers)


def warm_up(stage: PagedStage, chunk: int = WARM_UP_TOKENS) -> None:
    """Run one prefill chunk of ``chunk`` tokens and one decode step on a throw-away pool, so the
    first real step after activation finds the plugin's kernels for those shapes made (a replay is
    chunks of the token budget, then decodes); the pool is dropped again (the ring's first step
    allocates its own)."""
    size = stage.block_size
    held = blocks_needed(chunk + 1, size)
    pool = SCRATCH_BLOCKS + held
    stage.allocate(pool, pool * stage.block_bytes)
    blocks = tuple(range(SCRATCH_BLOCKS, pool))
    hidden = stage.spec.activation_input_width or stage.manifest.model.hidden_size
    try:
        for past, new in ((0, chunk), (chunk, 1)):
            plan = StepPlan(size, pool, (PlanRow(1, past, new, blocks[:blocks_needed(past + new, size)]),))
            rows = plan.padded_tokens
            x = np.zeros(rows, np.int64) if stage.spec.has_embedding else np.zeros((rows, hidden), np.float32)
            stage.run(plan, x)
    finally:
        stage.caches, stage.pool_blocks = [], 0


def timing_line(times: Mapping[str, float]) -> str:
    return TIMING_PREFIX + json.dumps({k: round(v, 4) for k, v in times.items()}, separators=(",", ":"))
