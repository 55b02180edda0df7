"""One agent as the fleet service sees it, merged from what each source last said about it.

Pure (no sockets): `console.fleet.fleet.FleetModel` collects `Sighting`s from mDNS, the hub's
unicast registrations, "add by address" probes and the approvals file, plus the last status
poll and hub event, and `merge_record` turns them into one frozen `AgentRecord`.

Only what came over mutual TLS is believed: a hub registration or event (the hub saw the
sender's certificate), a probe or status poll (the service saw the agent's certificate), or the
approvals file (written from those). An mDNS record is anyone's claim: it lists a PC the service
has not verified yet (``verified=False``, not approvable) and suggests an address to probe, but
it never sets where a verified agent is or what state it is in. Among the proven sources, the
newest word wins for the state, the newest sighting for where the agent is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine.control.messages import AgentStatus

UNKNOWN_STATE = "unknown"  # approved earlier, not heard from since the fleet service started
UNVERIFIED_STATE = "unverified"  # this fleet's agent by an mDNS record alone: not proven, nothing it claims shown


class AgentSource(StrEnum):
    """Where the fleet service heard of an agent."""

    MDNS = "mdns"  # the agent's DNS-SD advertisement: a claim (a hint to probe), never proof
    PROBE = "probe"  # the service probed an mDNS hint's address and the agent proved its node id
    HUB = "hub"  # a unicast registration at the service's hub (networks that drop multicast)
    ADDRESS = "address"  # the admin added it by address (GET /v1/probe)
    SAVED = "saved"  # approved earlier: address kept in the approvals file


class Membership(StrEnum):
    """Whether an agent has joined this service's fleet."""

    MEMBER = "member"
    OTHER_FLEET = "other-fleet"
    NOT_JOINED = "not-joined"


def membership_of(fleet_id: str, own_fleet_id: str) -> Membership:
    if not fleet_id:
        return Membership.NOT_JOINED
    return Membership.MEMBER if fleet_id == own_fleet_id else Membership.OTHER_FLEET


@dataclass(frozen=True)
class Sighting:
    """What one source said about an agent, at monotonic time ``at`` (None: from the saved list)."""

    source: AgentSource
    name: str
    address: str
    control_port: int
    fleet_id: str
    state: str = UNKNOWN_STATE
    devices: tuple[str, ...] = ()
    memory_bytes: int = 0
    version: str = ""
    instance: str = ""
    at: float | None = None


@dataclass(frozen=True)
class Poll:
    """The outcome of the last ``GET /v1/status``: the status, or why it failed."""

    at: float
    status: AgentStatus | None = None
    error: str | None = None


@dataclass(frozen=True)
class HubNews:
    """A paused/resumed event the agent sent to the hub."""

    at: float
    state: str
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class AgentRecord:
    """One agent in the fleet service's list. ``node_id`` is "" for an agent that has joined no fleet
    (it is then known by its mDNS ``instance``; see ``key``). ``last_seen`` is the monotonic
    time the service last heard from it (None: only known from the approvals file).
    ``reachable`` is None until a status poll was tried; ``error`` says why the last one failed.
    """

    node_id: str
    name: str
    address: str
    control_port: int
    state: str
    devices: tuple[str, ...]
    memory_bytes: int
    fleet_id: str
    membership: Membership
    last_seen: float | None
    sources: frozenset[AgentSource]
    approved: bool
    status: AgentStatus | None = None
    reachable: bool | None = None
    error: str | None = None
    paused_reasons: tuple[str, ...] = ()
    version: str = ""
    instance: str = ""
    verified: bool = False  # heard of over mutual TLS (hub, probe, poll, approvals): approvable
    tags: tuple[str, ...] = ()  # the admin's tags for it, else its own (console.fleet.agent_tags)
    tags_set_by: str = "agent"  # "admin" while the admin's tags stand

    @property
    def key(self) -> str:
        """The record's id in the fleet service: the node id, or ``instance:<name>`` before a join."""
        return self.node_id or f"instance:{self.instance}"

    @property
    def control_address(self) -> str:
        return f"{self.address}:{self.control_port}"

    @property
    def paused(self) -> bool:
        return self.state == "paused"

    @property
    def on_battery(self) -> bool:
        """True only when the last status said the PC runs on battery (None/absent: mains)."""
        return self.status is not None and self.status.inventory.get("on_ac") is False


def devices_of(inventory: Mapping[str, Any]) -> tuple[str, ...]:
    """OpenVINO device names from an agent's inventory (malformed entries skipped)."""
    return tuple(d["name"] for d in inventory.get("devices", ())
                 if isinstance(d, dict) and isinstance(d.get("name"), str))


def merge_record(key: str, sightings: Mapping[AgentSource, Sighting], *, own_fleet_id: str,
                 approved: bool, poll: Poll | None = None, news: HubNews | None = None,
                 tags: tuple[str, ...] = (), tags_set_by: str = "agent") -> AgentRecord:
    """The record for ``key`` from every source's last word. ``sightings`` must not be empty;
    ``tags`` are the agent's as the service keeps them (`console.fleet.agent_tags`)."""
    ordered = sorted(sightings.values(), key=lambda s: -1.0 if s.at is None else s.at)
    proven = [s for s in ordered if s.source is not AgentSource.MDNS]
    believed = proven or ordered  # an mDNS claim counts only while nothing proven is known
    where = believed[-1]  # newest believed sighting: where the agent is now
    named = next((s for s in reversed(believed) if s.name), where)
    times = [s.at for s in ordered if s.at is not None]
    # (time, state, reasons) from every believed source that reports a state; the newest wins
    states: list[tuple[float, str, tuple[str, ...]]] = [
        (s.at, s.state, ()) for s in believed if s.at is not None and s.state != UNKNOWN_STATE]
    # hardware facts (shown until a poll reports the inventory): a proven source's, else those of
    # an mDNS record from the proven address (the same agent's own advertisement)
    facts = next((s for s in reversed(believed) if s.devices), None) or next(
        (s for s in reversed(ordered)
         if s.devices and (s.address, s.control_port) == (where.address, where.control_port)),
        where)
    name, devices, memory, version = named.name, facts.devices, facts.memory_bytes, where.version or facts.version
    fleet_id = where.fleet_id
    status, reachable, error = None, None, None
    verified = bool(proven)
    if poll is not None:
        reachable, error = poll.status is not None, poll.error
        if poll.status is not None:
            verified = True
            status = poll.status
            times.append(poll.at)
            states.append((poll.at, status.state, status.paused_reasons))
            name, version, fleet_id = status.name or name, status.version, status.fleet_id
            devices = devices_of(status.inventory) or devices
            memory = int(status.inventory.get("ram_total") or memory)
    if news is not None:
        times.append(news.at)
        states.append((news.at, news.state, news.reasons))
    _, state, reasons = max(states, key=lambda s: s[0]) if states else (None, where.state, ())
    membership = membership_of(fleet_id, own_fleet_id)
    if not verified and membership is Membership.MEMBER:
        state, reasons = UNVERIFIED_STATE, ()
    return AgentRecord(
        node_id=key if not key.startswith("instance:") else "", name=name, address=where.address,
        control_port=where.control_port, state=state, devices=devices, memory_bytes=memory,
        fleet_id=fleet_id, membership=membership,
        last_seen=max(times) if times else None, sources=frozenset(sightings), approved=approved,
        status=status, reachable=reachable, error=error, paused_reasons=tuple(reasons),
        version=version, instance=next((s.instance for s in reversed(ordered) if s.instance), ""),
        verified=verified, tags=tags, tags_set_by=tags_set_by)
