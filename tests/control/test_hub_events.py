"""What the hub keeps of its members' reports (engine/control/hub_events.py): the pure policy, and
the hub's routes enforcing it over mutual TLS on loopback. The whole attack (a joined PC flooding a
real fleet service) is tests/security/test_hub_flood.py, in the slow lane."""

from __future__ import annotations

import json

import aiohttp
import pytest

from engine.control.hub import FleetHub
from engine.control.hub_events import (
    MAX_DETAIL_CHARS,
    MAX_REASONS,
    AgentEvent,
    EventLog,
    MemberRate,
    event_body,
    held_size,
    public_body,
)
from engine.control.messages import ControlRequestError
from engine.trust.fleet_ca import FleetAuthority, Role
from tests.support.asyncutil import run


def _event(node: str, i: int, pad: int = 0) -> AgentEvent:
    body = event_body({"event": "paused", "reasons": [str(i)], "detail": "d" * pad})
    return AgentEvent(node, "paused", body, float(i), held_size(body))


def test_an_event_keeps_only_its_fields_trimmed():
    body = event_body({"event": "worker-lost", "reasons": ["a" * 500, 3, None, *["r"] * 50], "stage": True,
                       "export_id": ["x"], "detail": "d" * 10_000, "node_id": "someone-else", "k0": 0})
    assert set(body) == {"event", "reasons", "export_id", "stage", "detail"}
    assert len(body["reasons"]) == MAX_REASONS and len(body["reasons"][0]) == 64
    assert body["stage"] is None and body["export_id"] is None and len(body["detail"]) == MAX_DETAIL_CHARS
    assert event_body({"event": "paused", "stage": 2})["stage"] == 2
    for bad in ({}, {"event": "registered"}, {"event": ["paused"]}):
        with pytest.raises(ControlRequestError) as refused:
            event_body(bad)
        assert refused.value.status == 400 and "worker-lost" in str(refused.value)


def test_a_registration_reaches_the_feed_as_its_address_only():
    event = AgentEvent("n1", "registered", {"address": "10.0.0.7", "control_port": 7210,
                                            "advertisement": {"pad": "x" * 9000}}, 0.0)
    assert public_body(event) == {"address": "10.0.0.7", "control_port": 7210}


def test_a_member_over_its_share_loses_only_its_own_oldest():
    log = EventLog(keep=100, max_bytes=1 << 20, per_member=5, member_bytes=1 << 20)
    log.append(_event("alice", 0))
    for i in range(50):
        log.append(_event("mallory", i))
    assert [e.body["reasons"] for e in log.of("mallory")] == [[str(i)] for i in range(45, 50)]
    assert len(log.of("alice")) == 1 and len(log) == 6

    by_bytes = EventLog(keep=100, max_bytes=1 << 20, per_member=100, member_bytes=2000)
    for i in range(20):
        by_bytes.append(_event("mallory", i, pad=200))
    held = by_bytes.member_bytes_held("mallory")
    assert held <= 2000 and by_bytes.held_bytes == held


def test_a_full_log_evicts_from_whoever_holds_the_most():
    log = EventLog(keep=10, max_bytes=1 << 20, per_member=8, member_bytes=1 << 20)
    for node in ("alice", "bob"):
        log.append(_event(node, 0))
    for i in range(8):  # mallory at its per-member cap
        log.append(_event("mallory", i))
    for node in ("carol", "dave", "erin"):  # the log is full: mallory, the largest holder, pays
        log.append(_event(node, 0))
    assert len(log) == 10 and len(log.of("mallory")) == 5
    assert all(len(log.of(n)) == 1 for n in ("alice", "bob", "carol", "dave", "erin"))

    small = EventLog(keep=1000, max_bytes=3 * held_size(_event("x", 0).body), per_member=10, member_bytes=1 << 20)
    for node in ("a", "b", "c", "d"):
        small.append(_event(node, 0))
    assert small.held_bytes <= small.max_bytes and len(small) == 3


def test_a_member_rate_admits_its_burst_then_its_rate():
    now = [0.0]
    rate = MemberRate(per_minute=60, burst=3, clock=lambda: now[0])
    assert [rate.admit("m") for _ in range(3)] == [None, None, None]
    wait = rate.admit("m")
    assert wait is not None and 0.9 < wait <= 1.0
    assert rate.admit("other") is None  # one member's bucket is its own
    now[0] += 1.0
    assert rate.admit("m") is None and rate.admit("m") is not None
    now[0] += 3600
    assert [rate.admit("m") for _ in range(4)].count(None) == 3  # idle time refills no more than the burst


def test_the_hub_refuses_a_large_report_naming_the_limit_and_a_member_past_its_rate():
    authority = FleetAuthority.create("hub-limits")
    hub = FleetHub(authority.issue_credentials("console", role=Role.CONSOLE),
                   rate=MemberRate(per_minute=1, burst=3))
    mallory, alice = (authority.issue_credentials(n, role=Role.AGENT) for n in ("mallory", "alice"))

    async def main():
        await hub.async_start("127.0.0.1", 0)
        try:
            answers = []
            for who, body in ((mallory, {"event": "paused", "pad": "x" * 5000}),
                              *[(mallory, {"event": "paused", "junk": "j" * 100})] * 4,
                              (alice, {"event": "resumed"})):
                connector = aiohttp.TCPConnector(ssl=who.client_context())
                async with aiohttp.ClientSession(connector=connector) as session:
                    async with session.post(hub.events_url, data=json.dumps(body)) as resp:
                        answers.append((resp.status, resp.headers.get("Retry-After"), await resp.text()))
            return answers
        finally:
            await hub.async_close()

    answers = run(main(), 60)
    assert answers[0][0] == 413 and "4096 bytes" in answers[0][2]
    assert [a[0] for a in answers[1:]] == [200, 200, 200, 429, 200]  # the 413 cost no share of the rate
    assert answers[4][1] is not None and int(answers[4][1]) >= 1 and "reports a minute" in answers[4][2]
    assert [e.event for e in hub.events] == ["paused"] * 3 + ["resumed"]
    assert all("junk" not in e.body for e in hub.events) and hub.refused == {"too_large": 1, "rate": 1}
