"""The agents the console knows: discovered over mDNS, registered at the hub by unicast, or
added by address; approved (or not) by the admin; polled for their status; paused and resumed.

`FleetModel` holds the sources' last words and merges them into `AgentRecord`s (the merge is
pure, in `console.service.agent_record`); it lives on the console's one asyncio loop and is not
thread-safe. Listeners get the new list of records after every change, on the loop: the Qt
view forwards them to the GUI thread with a queued signal.

An agent's node id is only trusted as far as its source: an mDNS record is what a peer claims,
whereas a hub registration, a probe and a status poll come over mutual TLS against the fleet CA.
Approving is refused for an agent that, as far as the console can tell, is in another fleet
or none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from console.service.agent_record import (
    UNKNOWN_STATE,
    AgentRecord,
    AgentSource,
    HubNews,
    Membership,
    Poll,
    Sighting,
    merge_record,
)
from console.service.approvals import ApprovalBook
from console.service.errors import (
    AgentRefusedError,
    AgentUnreachableError,
    ForeignAgentError,
    UnknownAgentError,
)
from engine.control_client import ControlClient, ControlError
from engine.discovery import Peer
from engine.fleet_hub import AgentEvent, FleetHub
from engine.trust import Credentials

__all__ = ["AgentRecord", "AgentSource", "FleetModel", "Membership"]

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 5.0
Listener = Callable[[tuple[AgentRecord, ...]], None]


class FleetModel:
    """``credentials`` is the console's own fleet certificate (``FleetHost.credentials``)."""

    def __init__(self, state_dir: Path, credentials: Credentials, *, timeout: float = POLL_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state_dir = Path(state_dir)
        self.credentials = credentials
        self.fleet_id = credentials.fleet_id
        self.timeout = timeout
        self._clock = clock
        self._approvals = ApprovalBook(state_dir)  # raises ConsoleStateError for a corrupt file
        self._sightings: dict[str, dict[AgentSource, Sighting]] = {}
        self._polls: dict[str, Poll] = {}
        self._news: dict[str, HubNews] = {}
        self._records: dict[str, AgentRecord] = {}
        self._listeners: list[Listener] = []
        for node_id in self._approvals.approved:
            self._sightings[node_id] = {}
        self._rebuild()

    # ---- reading -----------------------------------------------------------------------------

    def records(self) -> tuple[AgentRecord, ...]:
        """Every known agent, ordered by name."""
        return tuple(sorted(self._records.values(), key=lambda r: (r.name.lower(), r.key)))

    def get(self, key: str) -> AgentRecord:
        """The record of node id ``key`` (or ``instance:<name>`` for an agent not joined yet)."""
        try:
            return self._records[key]
        except KeyError:
            raise UnknownAgentError(f"no agent {key[:16]}… is known to the console; refresh the "
                                    "agent list, or add the PC by address") from None

    def approved(self) -> tuple[AgentRecord, ...]:
        return tuple(r for r in self.records() if r.approved)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """``listener(records)`` after every change; returns a function that unsubscribes it."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # ---- sources -----------------------------------------------------------------------------

    def update_peers(self, peers: Mapping[str, Peer]) -> None:
        """Take the mDNS browser's snapshot (use as ``Browser(interface, fleet.update_peers)``):
        agents that left the snapshot lose their mDNS source."""
        fresh: dict[str, Sighting] = {}
        for peer in peers.values():
            ad = peer.advertisement
            key = ad.node_id or f"instance:{ad.instance}"
            fresh[key] = Sighting(AgentSource.MDNS, ad.instance.rsplit("-", 1)[0] or ad.instance,
                                  ad.addresses[0] if ad.addresses else "", ad.control_port, ad.fleet_id,
                                  ad.state.value, ad.devices, ad.memory_bytes, ad.version, ad.instance,
                                  peer.last_seen)
        for key, by_source in self._sightings.items():
            if key not in fresh:
                by_source.pop(AgentSource.MDNS, None)
        for key, sighting in fresh.items():
            self._sightings.setdefault(key, {})[AgentSource.MDNS] = sighting
        self._rebuild()

    def attach_hub(self, hub: FleetHub) -> Callable[[], None]:
        """Take the hub's registrations so far and every registration and event from now on;
        returns a function that detaches."""
        for node_id, body in list(hub.registrations.items()):
            self._take_registration(node_id, body, self._clock())
        self._rebuild()
        return hub.subscribe(self.on_hub_event)

    def on_hub_event(self, event: AgentEvent) -> None:
        """A registration (unicast discovery) or a paused/resumed report from an agent; the hub
        checked the sender's fleet certificate, so ``event.node_id`` is who sent it."""
        now = self._clock()
        if event.event == "registered":
            self._take_registration(event.node_id, event.body, now)
        elif event.node_id in self._sightings:
            reasons = event.body.get("reasons")
            reasons = tuple(r for r in reasons if isinstance(r, str)) if isinstance(reasons, list) else ()
            # after a resume the agent is idle or serving again; the next poll tells which
            state = "paused" if event.event == "paused" else self._unpaused_state(event.node_id)
            self._news[event.node_id] = HubNews(now, state, reasons if state == "paused" else ())
        else:
            log.info("event %r from unknown agent %s ignored", event.event, event.node_id[:16])
            return
        self._rebuild()

    async def async_add_address(self, host: str, port: int) -> AgentRecord:
        """Probe ``GET /v1/probe`` at ``host:port`` and add the agent that answers. Only a member
        of this fleet can answer: the control API is mutual TLS against the fleet CA."""
        client = ControlClient(self.credentials, host, port, timeout=self.timeout)
        try:
            probe = await client.async_probe()
        except ControlError as exc:
            raise AgentUnreachableError(
                f"no Deskfleet agent of this fleet answered at {host}:{port} ({exc}); check the address "
                "and the control port (7210 by default), that the PC is on and its firewall lets the "
                "port through, and that it joined this console's fleet") from exc
        node_id = probe.get("node_id")
        if not isinstance(node_id, str) or not node_id:
            raise ForeignAgentError(f"the agent at {host}:{port} has not joined a fleet; join it with a "
                                    "token from this console first")
        fleet_id = probe.get("fleet_id") if isinstance(probe.get("fleet_id"), str) else ""
        self._sightings.setdefault(node_id, {})[AgentSource.ADDRESS] = Sighting(
            AgentSource.ADDRESS, str(probe.get("name", "")), host, int(probe.get("control_port") or port),
            fleet_id, str(probe.get("state", UNKNOWN_STATE)), version=str(probe.get("version", "")),
            at=self._clock())
        self._rebuild()
        return self._records[node_id]

    # ---- approval ----------------------------------------------------------------------------

    def approve(self, node_id: str) -> AgentRecord:
        """Allow placement to use this agent (persisted). Refused for another fleet's agent."""
        record = self.get(node_id)
        if record.membership is Membership.OTHER_FLEET:
            raise ForeignAgentError(
                f"{record.name} belongs to another fleet (fleet {record.fleet_id[:16]}…) and cannot be "
                "approved here; to use it, leave that fleet from its tray menu and join this one "
                "with a join token from this console")
        if record.membership is Membership.NOT_JOINED:
            raise ForeignAgentError(f"{record.name} has not joined a fleet yet; give the person at that "
                                    "PC a join token from this console, then approve it")
        self._approvals.add(node_id, record.name, record.address, record.control_port, record.fleet_id)
        self._rebuild()
        return self._records[node_id]

    def remove(self, node_id: str) -> None:
        """Withdraw the approval and forget the agent. It is listed again, unapproved, when it
        next advertises or registers (its fleet certificate stays valid)."""
        self.get(node_id)
        self._approvals.discard(node_id)
        for table in (self._sightings, self._polls, self._news):
            table.pop(node_id, None)
        self._rebuild()

    # ---- control -----------------------------------------------------------------------------

    def client(self, node_id: str) -> ControlClient:
        """A control client for a member agent (raises for another fleet's or an unknown one)."""
        record = self.get(node_id)
        if record.membership is not Membership.MEMBER or not record.control_port:
            raise ForeignAgentError(f"{record.name} is not a member of this fleet (it is "
                                    f"{record.membership.value}); the console cannot control it")
        return ControlClient(self.credentials, record.address, record.control_port, timeout=self.timeout)

    async def async_refresh(self) -> tuple[AgentRecord, ...]:
        """Poll every member agent's status at once; an agent that does not answer within the
        timeout is marked unreachable (``reachable=False``, ``error``), never dropped."""
        keys = [r.key for r in self.records() if r.membership is Membership.MEMBER and r.control_port]
        await asyncio.gather(*(self._async_poll(k) for k in keys))
        self._rebuild()
        return self.records()

    async def async_refresh_one(self, node_id: str) -> AgentRecord:
        self.client(node_id)
        await self._async_poll(node_id)
        self._rebuild()
        return self._records[node_id]

    async def async_pause(self, node_id: str) -> AgentRecord:
        """The console's pause: the agent stops its worker and stays paused until resumed."""
        await self._async_control(node_id, "pause")
        return await self.async_refresh_one(node_id)

    async def async_resume(self, node_id: str) -> AgentRecord:
        await self._async_control(node_id, "resume")
        return await self.async_refresh_one(node_id)

    # ---- internals ---------------------------------------------------------------------------

    async def _async_control(self, node_id: str, action: str) -> None:
        client = self.client(node_id)
        name = self.get(node_id).name
        try:
            await (client.async_pause() if action == "pause" else client.async_resume())
        except ControlError as exc:
            if exc.status == 0:
                raise AgentUnreachableError(f"could not {action} {name}: its control API did not answer "
                                            f"({exc}); check that the PC is on and reachable") from exc
            raise AgentRefusedError(f"{name} refused to {action}: {exc}", exc.status) from exc

    async def _async_poll(self, key: str) -> None:
        record = self._records.get(key)
        if record is None:
            return
        client = ControlClient(self.credentials, record.address, record.control_port, timeout=self.timeout)
        try:
            status = await client.async_status()
        except ControlError as exc:
            log.debug("status poll of %s failed: %s", record.name, exc)
            poll = Poll(self._clock(), error=f"unreachable at {record.control_address}: {exc}")
        else:
            if status.node_id != key:
                poll = Poll(self._clock(), error=f"{record.control_address} now answers as another agent "
                                                 f"({status.node_id[:16]}…); the agent moved or was re-joined")
            else:
                poll = Poll(self._clock(), status=status)
        if key in self._sightings:  # removed while the poll was in flight: stay forgotten
            self._polls[key] = poll

    def _take_registration(self, node_id: str, body: Mapping, at: float) -> None:
        props = body.get("advertisement") if isinstance(body.get("advertisement"), dict) else {}
        port, address = body.get("control_port"), body.get("address")
        if not (isinstance(port, int) and 0 < port < 65536 and isinstance(address, str) and address):
            log.warning("registration from %s without a control address ignored", node_id[:16])
            return
        devices = props.get("dev") if isinstance(props.get("dev"), str) else ""
        memory = props.get("mem") if isinstance(props.get("mem"), str) and props["mem"].isdigit() else "0"
        self._sightings.setdefault(node_id, {})[AgentSource.HUB] = Sighting(
            AgentSource.HUB, "", address, port, self.fleet_id,  # the hub checked its certificate
            str(props.get("st") or UNKNOWN_STATE), tuple(d for d in devices.split(",") if d), int(memory),
            str(props.get("ver", "")), at=at)

    def _unpaused_state(self, node_id: str) -> str:
        record = self._records.get(node_id)
        worker = record.status.worker.state if record is not None and record.status is not None else ""
        return "serving" if worker in ("starting", "running", "backoff") else "idle"

    def _rebuild(self) -> None:
        for key in [k for k, s in self._sightings.items() if not s and k not in self._approvals]:
            del self._sightings[key]
            self._polls.pop(key, None)
            self._news.pop(key, None)
        records = {}
        for key, by_source in self._sightings.items():
            if len(by_source) > 1:  # heard from again: the saved address is no longer news
                by_source.pop(AgentSource.SAVED, None)
            if not by_source:  # approved, but no source lists it now: keep where it was last
                a = self._approvals.approved[key]
                by_source[AgentSource.SAVED] = Sighting(AgentSource.SAVED, a.name, a.address,
                                                        a.control_port, a.fleet_id)
            records[key] = merge_record(key, by_source, own_fleet_id=self.fleet_id,
                                        approved=key in self._approvals, poll=self._polls.get(key),
                                        news=self._news.get(key))
        if records == self._records:
            return
        self._records = records
        snapshot = self.records()
        for listener in list(self._listeners):
            try:
                listener(snapshot)
            except Exception:
                log.exception("fleet listener failed")
