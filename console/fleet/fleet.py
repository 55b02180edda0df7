"""The agents the fleet service knows: discovered over mDNS, registered at the hub by unicast, or
added by address; approved (or not) by the admin; polled for their status; paused and resumed.

`FleetModel` holds the sources' last words and merges them into `AgentRecord`s (the merge is
pure, in `console.fleet_api.agent_record`); it lives on the fleet service's one asyncio loop and is not
thread-safe. Listeners get the new list of records after every change, on the loop: the Qt
view forwards them to the GUI thread with a queued signal. One source's news re-merges that
agent's record only, and a status round polls a few agents at a time over one TLS context: at
1,000 agents re-merging every record per registration, and a thousand handshakes at once every
round, were what kept the service busy (docs/BENCHMARKS.md, fleet-scale).

Node ids come only from certificates: the hub's caller, the peer of a probe or a status poll
(each control client checks ``sha256(peer certificate)`` against the node id it dials). An mDNS
record is what anyone on the LAN may claim: it lists a PC as unverified and suggests an address
to probe (a few probes at a time, each address at most every ``PROBE_RETRY_S``); it never moves
a verified agent or changes its state, and never makes a node id approvable. Approving is
refused for an agent that is not verified, or that is, as far as the fleet service can tell, in
another fleet or none. Removing an agent revokes it (console.fleet.revocations).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from console.fleet.agent_tags import TagBook
from console.fleet.approvals import ApprovalBook
from console.fleet.errors import (
    AgentRefusedError,
    AgentUnreachableError,
    ForeignAgentError,
    UnknownAgentError,
)
from console.fleet.revocations import RevocationBook
from console.fleet_api.agent_record import (
    UNKNOWN_STATE,
    AgentRecord,
    AgentSource,
    HubNews,
    Membership,
    Poll,
    Sighting,
    merge_record,
)
from engine.control.client import ControlClient, ControlError, WrongAgentError
from engine.control.hub import AgentEvent, FleetHub
from engine.control.tags import reported_tags
from engine.discovery.mdns import Peer
from engine.tasks import start_task
from engine.trust.fleet_ca import Credentials

__all__ = ["AgentRecord", "AgentSource", "FleetModel", "Membership"]

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 5.0
MAX_HINTS = 256  # mDNS records kept from one snapshot: an office, with room; a flood is cut here
MAX_PROBES = 4  # probes of mDNS hints in flight at once
MAX_POLLS = 32  # status polls in flight at once in a refresh round
PROBE_RETRY_S = 30.0  # an mDNS hint's address is probed at most this often
Listener = Callable[[tuple[AgentRecord, ...]], None]


class FleetModel:
    """``credentials`` is the fleet service's own fleet certificate (``FleetHost.credentials``)."""

    def __init__(self, state_dir: Path, credentials: Credentials, *, timeout: float = POLL_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state_dir = Path(state_dir)
        self.credentials = credentials
        self.fleet_id = credentials.fleet_id
        self.timeout = timeout
        self._clock = clock
        self._ssl = credentials.client_context()  # one context for every control client: loading it costs ~1 ms
        self._approvals = ApprovalBook(state_dir)  # raises FleetStateError for a corrupt file
        self._revoked = RevocationBook(state_dir)
        self._tags = TagBook(state_dir)  # raises FleetStateError for a corrupt file
        self._hub: FleetHub | None = None
        self._rotate_api_key: Callable[[], str] | None = None  # FleetHost.rotate_api_key, once attached
        self._api_key: str | None = None  # the `console` key the last removal rotated to (never sent to members)
        self._member_key: Callable[[str], str | None] | None = None  # FleetHost.member_key, once attached
        self._probed: dict[tuple[str, str, int], float] = {}  # (claimed key, host, port) -> when
        self._probes: set[asyncio.Task] = set()
        self._probe_slots = asyncio.Semaphore(MAX_PROBES)
        self._warned: set[tuple[str, str, int]] = set()
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
            raise UnknownAgentError(f"no agent {key[:16]}… is known to the fleet service; refresh the "
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
        agents that left the snapshot lose their mDNS source. Records are hints only: a new
        address of this fleet's agent is probed over mutual TLS (on the loop, if one runs)."""
        fresh: dict[str, Sighting] = {}
        newest = sorted(peers.values(), key=lambda p: -p.last_seen)
        for peer in newest[:MAX_HINTS]:
            ad = peer.advertisement
            key = ad.node_id or f"instance:{ad.instance}"
            if key in self._revoked:
                continue
            sighting = Sighting(AgentSource.MDNS, ad.instance.rsplit("-", 1)[0] or ad.instance,
                                ad.addresses[0] if ad.addresses else "", ad.control_port, ad.fleet_id,
                                ad.state.value, ad.devices, ad.memory_bytes, ad.version, ad.instance,
                                peer.last_seen)
            self._consider_probe(key, sighting)  # every record's address, even if two claim one id
            fresh.setdefault(key, sighting)  # newest first
        if len(newest) > MAX_HINTS:
            log.warning("%d mDNS records on the network; only the %d newest are listed", len(newest), MAX_HINTS)
        for key, by_source in self._sightings.items():
            if key not in fresh:
                by_source.pop(AgentSource.MDNS, None)
        for key, sighting in fresh.items():
            self._sightings.setdefault(key, {})[AgentSource.MDNS] = sighting
        self._rebuild()

    def _consider_probe(self, key: str, hint: Sighting) -> None:
        """Probe an mDNS hint's address unless it says nothing new about a verified agent."""
        if hint.fleet_id != self.fleet_id or not hint.address or not hint.control_port:
            return
        record = self._records.get(key)
        where = (key, hint.address, hint.control_port)
        if record is not None and record.verified:
            if (record.address, record.control_port) == (hint.address, hint.control_port):
                return
            if where not in self._warned:
                if len(self._warned) > 4 * MAX_HINTS:  # a stream of forged records must not grow it for ever
                    self._warned.clear()
                self._warned.add(where)
                log.warning("an mDNS record claims agent %s (%s) is at %s:%d; the fleet service keeps %s until a "
                            "probe there proves it", key[:16], record.name, hint.address, hint.control_port,
                            record.control_address)
        now = self._clock()
        if now - self._probed.get(where, -PROBE_RETRY_S) < PROBE_RETRY_S or len(self._probes) >= 4 * MAX_PROBES:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a pure caller): hints stay hints
        self._probed[where] = now
        if len(self._probed) > 4 * MAX_HINTS:  # forget the oldest attempts
            for old in sorted(self._probed, key=self._probed.__getitem__)[:MAX_HINTS]:
                del self._probed[old]
        start_task(self._async_probe_hint(key, hint.address, hint.control_port), name="deskfleet-probe-hint",
                   logger=log, keep=self._probes)

    async def _async_probe_hint(self, claimed: str, host: str, port: int) -> None:
        async with self._probe_slots:
            client = ControlClient(self.credentials, host, port, timeout=self.timeout, ssl_context=self._ssl)
            try:
                probe = await client.async_probe()
            except ControlError as exc:
                log.info("mDNS hint %s at %s:%d not verified: %s", claimed[:16], host, port, exc)
                return
        proven = client.peer_node_id
        if proven is None:
            return
        if proven != claimed:
            log.warning("an mDNS record named agent %s at %s:%d, but the agent there proved to be %s; the "
                        "record's claim is ignored", claimed[:16], host, port, proven[:16])
        self._take_proof(proven, host, port, probe, AgentSource.PROBE)
        self._rebuild((proven,))

    def _take_proof(self, node_id: str, host: str, port: int, probe: Mapping, source: AgentSource) -> bool:
        """Record what an agent said over a connection whose certificate proved ``node_id``."""
        probe = probe if isinstance(probe, Mapping) else {}
        if node_id in self._revoked:
            log.warning("revoked agent %s answered at %s:%d; ignored", node_id[:16], host, port)
            return False
        self._sightings.setdefault(node_id, {})[source] = Sighting(
            source, str(probe.get("name", ""))[:64], host, port, self.fleet_id,  # the CA signed its certificate
            str(probe.get("state", UNKNOWN_STATE))[:32], version=str(probe.get("version", ""))[:64],
            at=self._clock())
        return True

    def attach_hub(self, hub: FleetHub) -> Callable[[], None]:
        """Take the hub's registrations so far and every registration and event from now on;
        returns a function that detaches."""
        self._hub = hub
        hub.set_deny(self._revoked.node_ids)
        for node_id, body in list(hub.registrations.items()):
            self._take_registration(node_id, body, self._clock())
        self._rebuild()
        unsubscribe = hub.subscribe(self.on_hub_event)

        def detach() -> None:
            self._hub = None
            unsubscribe()

        return detach

    def attach_api_key(self, rotate: Callable[[], str],
                       member_key: Callable[[str], str | None] | None = None) -> Callable[[], None]:
        """Removing a member from now on calls ``rotate()`` (``FleetHost.rotate_api_key``): older
        versions put the `console` key in every assignment. The deny list then carries each member's
        own key (``member_key(node id)``, ``FleetHost.member_key``), never the new console key.
        Returns a function that detaches."""
        self._rotate_api_key = rotate
        self._member_key = member_key

        def detach() -> None:
            self._rotate_api_key = None
            self._member_key = None

        return detach

    def on_hub_event(self, event: AgentEvent) -> None:
        """A registration (unicast discovery) or a paused/resumed report from an agent; the hub
        checked the sender's fleet certificate, so ``event.node_id`` is who sent it."""
        now = self._clock()
        if event.node_id in self._revoked:
            log.warning("%s from revoked agent %s ignored", event.event, event.node_id[:16])
            return
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
        self._rebuild((event.node_id,))

    async def async_add_address(self, host: str, port: int) -> AgentRecord:
        """Probe ``GET /v1/probe`` at ``host:port`` and add the agent that answers. Only a member
        of this fleet can answer: the control API is mutual TLS against the fleet CA."""
        client = ControlClient(self.credentials, host, port, timeout=self.timeout, ssl_context=self._ssl)
        try:
            probe = await client.async_probe()
        except ControlError as exc:
            raise AgentUnreachableError(
                f"no Deskfleet agent of this fleet answered at {host}:{port} ({exc}); check the address "
                "and the control port (7210 by default), that the PC is on and its firewall lets the "
                "port through, and that it joined this fleet service's fleet") from exc
        node_id = client.peer_node_id
        if node_id is None:  # the client pins nothing here, so a completed probe saw a certificate
            raise AgentUnreachableError(f"the agent at {host}:{port} answered without a certificate the probe "
                                        "could read; check that it is a Deskfleet agent")
        claimed = probe.get("node_id") if isinstance(probe, dict) else None
        if not isinstance(claimed, str) or not claimed:
            raise ForeignAgentError(f"the agent at {host}:{port} has not joined a fleet; join it with a "
                                    "token from this fleet service first")
        if claimed != node_id:
            log.warning("the agent at %s:%d claims node id %s but its certificate is %s; the certificate "
                        "counts", host, port, claimed[:16], node_id[:16])
        if node_id in self._revoked:
            raise ForeignAgentError(f"the agent at {host}:{port} was removed from this fleet (its certificate "
                                    "is revoked); to use the PC again, join it with a new token")
        self._take_proof(node_id, host, port, probe, AgentSource.ADDRESS)
        self._rebuild((node_id,))
        return self._records[node_id]

    # ---- approval ----------------------------------------------------------------------------

    def approve(self, node_id: str) -> AgentRecord:
        """Allow placement to use this agent (persisted). Refused for another fleet's agent."""
        record = self.get(node_id)
        if not record.verified and record.membership is Membership.MEMBER:
            raise ForeignAgentError(
                f"{record.name} is only known from an mDNS record, which anyone on the network can send; "
                "the fleet service approves an agent once it proved its identity over mutual TLS (a probe of "
                "its address, or its registration at the hub). Wait a moment, or add the PC by address")
        if record.membership is Membership.OTHER_FLEET:
            raise ForeignAgentError(
                f"{record.name} belongs to another fleet (fleet {record.fleet_id[:16]}…) and cannot be "
                "approved here; to use it, leave that fleet from its tray menu and join this one "
                "with a join token from this fleet service")
        if record.membership is Membership.NOT_JOINED:
            raise ForeignAgentError(f"{record.name} has not joined a fleet yet; give the person at that "
                                    "PC a join token from this fleet service, then approve it")
        self._approvals.add(node_id, record.name, record.address, record.control_port, record.fleet_id)
        self._rebuild((node_id,))
        return self._records[node_id]

    def set_tags(self, node_id: str, tags: tuple[str, ...] | None) -> AgentRecord:
        """The admin's tags for a member (persisted; TagError for a bad one); None takes them
        away, so the agent's own count again."""
        record = self.get(node_id)
        if record.membership is not Membership.MEMBER or not record.node_id:
            raise ForeignAgentError(f"{record.name} is not a member of this fleet; tags are for its members")
        self._tags.set_admin(record.node_id, tags)
        self._rebuild((record.node_id,))
        return self._records[record.node_id]

    @property
    def deny(self) -> tuple[str, ...]:
        """The node ids the admin removed (sent with every assignment)."""
        return self._revoked.node_ids

    def remove(self, node_id: str) -> None:
        """Withdraw the approval, forget the agent and revoke its certificate: the hub refuses it,
        every member agent is told (``POST /v1/deny``, in the background when a loop runs) and
        the next assignments carry it. Only a fresh join (a new node id) brings the PC back."""
        record = self.get(node_id)
        self._approvals.discard(node_id)
        self._tags.discard(node_id)
        self._revoked.add(record.node_id, record.name)
        for table in (self._sightings, self._polls, self._news):
            table.pop(node_id, None)
        if self._hub is not None:
            self._hub.set_deny(self._revoked.node_ids)
            self._hub.revoke_grants(node_id)
        log.warning("removed agent %s (%s): its certificate is revoked", node_id[:16], record.name)
        self._rebuild((node_id,))
        if self._rotate_api_key is not None:  # its assignments carried the API key: a new one, now
            self._api_key = self._rotate_api_key()
            log.warning("the API key was rotated: the removed PC's copy no longer works")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no running loop: the next assignments carry both
        start_task(self.async_push_deny(), name="deskfleet-push-deny", logger=log, keep=self._probes)

    async def async_push_deny(self) -> dict[str, str]:
        """Send the deny list (and each member its own API key: the `console` key was rotated) to every
        verified member; {node id: why it failed} for those not told."""
        deny, rotated = self.deny, self._api_key is not None
        failed: dict[str, str] = {}
        records = [r for r in self.records() if r.verified and r.membership is Membership.MEMBER and r.control_port]

        async def one(record: AgentRecord) -> None:
            try:
                client = self.client(record.key)
            except UnknownAgentError:  # removed since the list was taken: it has no one to tell
                return
            try:
                own = self._member_key(record.node_id) if rotated and self._member_key is not None else None
                await client.async_deny(deny, own)
            except (ControlError, ForeignAgentError) as exc:
                log.warning("could not give %s the deny list: %s", record.name, exc)
                failed[record.key] = str(exc)

        await asyncio.gather(*(one(r) for r in records))
        return failed

    # ---- control -----------------------------------------------------------------------------

    def client(self, node_id: str) -> ControlClient:
        """A control client for a member agent (raises for another fleet's or an unknown one)."""
        record = self.get(node_id)
        if record.membership is not Membership.MEMBER or not record.control_port:
            raise ForeignAgentError(f"{record.name} is not a member of this fleet (it is "
                                    f"{record.membership.value}); the fleet service cannot control it")
        if not record.verified:
            raise ForeignAgentError(f"{record.name} has not proved its identity to the fleet service yet (it is "
                                    "only known from an mDNS record); wait for the probe, or add it by address")
        return ControlClient(self.credentials, record.address, record.control_port, timeout=self.timeout,
                             node_id=record.node_id, ssl_context=self._ssl)

    async def async_refresh(self) -> tuple[AgentRecord, ...]:
        """Poll every member agent's status at once; an agent that does not answer within the
        timeout is marked unreachable (``reachable=False``, ``error``), never dropped."""
        keys = [r.key for r in self.records()
                if r.membership is Membership.MEMBER and r.control_port and r.verified]
        slots = asyncio.Semaphore(MAX_POLLS)  # a thousand handshakes at once would stall the loop for seconds

        async def poll(key: str) -> None:
            async with slots:
                await self._async_poll(key)

        await asyncio.gather(*(poll(k) for k in keys))
        self._rebuild(keys)
        return self.records()

    async def async_refresh_one(self, node_id: str) -> AgentRecord:
        self.client(node_id)
        await self._async_poll(node_id)
        self._rebuild((node_id,))
        return self._records[node_id]

    async def async_pause(self, node_id: str) -> AgentRecord:
        """The fleet service's pause: the agent stops its worker and stays paused until resumed."""
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
        client = ControlClient(self.credentials, record.address, record.control_port, timeout=self.timeout,
                               node_id=key, ssl_context=self._ssl)  # the certificate must be this agent's
        try:
            status = await client.async_status()
        except WrongAgentError as exc:
            log.warning("status poll of %s refused: %s", record.name, exc)
            poll = Poll(self._clock(), error=f"{record.control_address} now answers as another agent "
                                             f"({(exc.node_id or '?')[:16]}…); the agent moved or was re-joined")
        except (ControlError, KeyError, TypeError, ValueError) as exc:
            log.debug("status poll of %s failed: %s", record.name, exc)
            poll = Poll(self._clock(), error=f"unreachable at {record.control_address}: {exc}")
        else:
            if status.node_id != key:  # the certificate is right; the body is not believed either way
                log.warning("agent %s writes node id %s in its status; ignored", key[:16], status.node_id[:16])
            # who it is and which fleet: what its certificate (signed by this fleet's CA) proved
            poll = Poll(self._clock(), status=replace(status, node_id=key, fleet_id=self.fleet_id))
        if key in self._sightings:  # removed while the poll was in flight: stay forgotten
            self._polls[key] = poll
            if poll.status is not None:
                self._tags.note_reported(key, poll.status.tags)  # written only when they changed

    def _take_registration(self, node_id: str, body: Mapping, at: float) -> None:
        if node_id in self._revoked:
            return
        advertised = body.get("advertisement")
        props: Mapping[str, Any] = advertised if isinstance(advertised, dict) else {}
        port, address = body.get("control_port"), body.get("address")
        if not (isinstance(port, int) and 0 < port < 65536 and isinstance(address, str) and address):
            log.warning("registration from %s without a control address ignored", node_id[:16])
            return
        if "tags" in body:  # an older agent's registration says nothing of tags: keep what is known
            self._tags.note_reported(node_id, reported_tags(body.get("tags")))
        dev, mem = props.get("dev"), props.get("mem")
        devices = dev if isinstance(dev, str) else ""
        memory = mem if isinstance(mem, str) and mem.isdigit() else "0"
        self._sightings.setdefault(node_id, {})[AgentSource.HUB] = Sighting(
            AgentSource.HUB, "", address, port, self.fleet_id,  # the hub checked its certificate
            str(props.get("st") or UNKNOWN_STATE), tuple(d for d in devices.split(",") if d), int(memory),
            str(props.get("ver", "")), at=at)

    def _unpaused_state(self, node_id: str) -> str:
        record = self._records.get(node_id)
        worker = record.status.worker.state if record is not None and record.status is not None else ""
        return "serving" if worker in ("starting", "running", "backoff") else "idle"

    def _rebuild(self, keys: Iterable[str] | None = None) -> None:
        """Merge the records of ``keys`` again (None: every agent's) and tell the listeners if any
        changed. Most news is one agent's: re-merging only it keeps a registration O(1)."""
        changed = False
        if keys is None:
            keys = list(self._sightings)
            for gone in [k for k in self._records if k not in self._sightings]:
                del self._records[gone]
                changed = True
        for key in dict.fromkeys(keys):
            by_source = self._sightings.get(key)
            if by_source is not None and not by_source and key not in self._approvals:
                del self._sightings[key]
                by_source = None
            if by_source is None:
                self._polls.pop(key, None)
                self._news.pop(key, None)
                changed |= self._records.pop(key, None) is not None
                continue
            if any(s not in (AgentSource.SAVED, AgentSource.MDNS) for s in by_source):
                # heard from again over mutual TLS: the saved address is no longer news (an mDNS
                # record alone does not replace it: it proves nothing, and the agent stays verified
                # and controllable until the record's probe answers)
                by_source.pop(AgentSource.SAVED, None)
            if not by_source:  # approved, but no source lists it now: keep where it was last
                a = self._approvals.approved[key]
                by_source[AgentSource.SAVED] = Sighting(AgentSource.SAVED, a.name, a.address,
                                                        a.control_port, a.fleet_id)
            tags = self._tags.get(key)  # the agent's last word (poll or registration), the admin's over it
            record = merge_record(key, by_source, own_fleet_id=self.fleet_id, approved=key in self._approvals,
                                  poll=self._polls.get(key), news=self._news.get(key), tags=tags.effective,
                                  tags_set_by=tags.set_by)
            if self._records.get(key) != record:
                self._records[key] = record
                changed = True
        if not changed:
            return
        snapshot = self.records()
        for listener in list(self._listeners):
            try:
                listener(snapshot)
            except Exception:
                log.exception("fleet listener failed")
