"""What keeps the fleet service affordable at 1,000 agents (docs/BENCHMARKS.md, fleet-scale):
the records event throttled and its JSON reused, the feed keeping only the newest records event
without making clients reset, the admin client reading a large answer whole, and the approvals
file written from each entry's kept JSON."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from console.fleet.approvals import ApprovalBook
from console.fleet.errors import FleetStateError
from console.fleet.records_feed import AgentJsonCache, RecordsPublisher
from console.fleet.service_events import EventFeed
from console.fleet_api.admin_client import AdminClient
from console.fleet_api.admin_shapes import agent_json
from console.fleet_api.agent_record import AgentRecord, AgentSource, Membership
from engine.state.db import DB_FILE, StateDB
from tests.support.asyncutil import run


def _record(i: int, *, last_seen: float = 100.0, state: str = "idle") -> AgentRecord:
    return AgentRecord(node_id=f"{i:064x}", name=f"pc-{i:04d}", address="10.0.0.1", control_port=7210 + i,
                       state=state, devices=("CPU",), memory_bytes=8 << 30, fleet_id="f" * 64,
                       membership=Membership.MEMBER, last_seen=last_seen, sources=frozenset({AgentSource.HUB}),
                       approved=True, verified=True)


def test_the_json_cache_reuses_unchanged_records_and_ages_them():
    cache = AgentJsonCache()
    records = [_record(i) for i in range(3)]
    first = cache.dump(records, now=110.0)
    assert first == [agent_json(r, now=110.0) for r in records]
    changed = [records[0], _record(1, state="paused"), records[2]]
    second = cache.dump(changed, now=115.0)
    assert second == [agent_json(r, now=115.0) for r in changed]  # the new state, and every age moved on
    assert second[0]["last_seen_s"] == 15.0 and first[0]["last_seen_s"] == 10.0  # the first answer untouched
    assert cache.dump(changed[:1], now=116.0) == [agent_json(changed[0], now=116.0)]  # a record gone: dropped


def test_records_are_published_at_once_after_a_quiet_spell_then_at_most_every_interval():
    async def main():
        now = [0.0]
        current = [_record(0)]
        published: list[list[dict]] = []
        pub = RecordsPublisher(lambda: current, published.append, every_s=0.2, clock=lambda: now[0])
        pub.on_records(tuple(current))
        assert len(published) == 1  # quiet before: at once
        for i in range(1, 6):  # a burst of changes: one publish at the end of the interval, with the last state
            current = [_record(j) for j in range(i + 1)]
            now[0] += 0.01
            pub.on_records(tuple(current))
        assert len(published) == 1
        now[0] = 0.25
        await asyncio.sleep(0.3)
        assert len(published) == 2 and [a["name"] for a in published[1]] == [f"pc-{j:04d}" for j in range(6)]
        now[0] = 1.0
        pub.on_records(tuple(current))  # quiet again: at once
        assert len(published) == 3
        pub.on_records(tuple(current))
        pub.cancel()  # closing: a scheduled publish is dropped
        await asyncio.sleep(0.3)
        assert len(published) == 3

    run(main(), 10)


def test_the_feed_keeps_only_the_newest_records_event_and_no_client_resets_for_it():
    async def main():
        feed = EventFeed(lambda: [("records", {"agents": []})], keep=5, latest_only=("records",))
        start = (await feed.poll(0, 1)).next
        feed.publish("records", {"agents": [1]})
        feed.publish("hub", {"event": "registered"})
        for n in range(2, 9):  # more records events than the feed keeps events
            feed.publish("records", {"agents": [n]})
        got = await feed.poll(start, 1)
        assert not got.reset  # the hub event is still there, and the newest records stand for the others
        assert [(e.kind, e.data) for e in got.events] == [("hub", {"event": "registered"}),
                                                          ("records", {"agents": [8]})]
        for i in range(4):  # other kinds still push the oldest out: a client that far behind resets
            feed.publish("job", {"i": i})
        assert (await feed.poll(start, 1)).reset
        recent = await feed.poll(got.next, 1)
        assert not recent.reset and [e.data["i"] for e in recent.events] == [0, 1, 2, 3]

    run(main(), 10)


def test_the_admin_client_reads_a_large_answer_whole(tmp_path):
    agents = [{"name": f"pc-{i:04d}", "status": {"inventory": {"pad": "x" * 1500}}} for i in range(2000)]

    async def main():
        app = web.Application()

        async def listing(request):
            return web.Response(body=json.dumps({"agents": agents}).encode(), content_type="application/json")

        app.router.add_get("/admin/v1/agents", listing)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = tmp_path / "admin.sock"
        await web.UnixSite(runner, str(sock)).start()
        try:
            async with AdminClient.over_socket(sock) as client:
                answer = await client.async_agents()
        finally:
            await runner.cleanup()
        assert answer["agents"] == agents  # ~3.5 MB: more than one read's worth

    run(main(), 30)


def test_approvals_are_rows_of_the_state_database_and_read_back(tmp_path):
    book = ApprovalBook(tmp_path)
    ids = [f"{i:064x}" for i in range(5)]
    for i, node_id in enumerate(ids):
        book.add(node_id, f"pc-{i}", "10.0.0.1", 7210 + i, "f" * 64)
    book.discard(ids[2])
    StateDB.forget(tmp_path)  # a restart: read from the file, not from this process's connection
    again = ApprovalBook(tmp_path)
    assert dict(again.approved) == dict(book.approved) and again.approved[ids[4]].control_port == 7214
    assert sorted(again.approved) == [ids[0], ids[1], ids[3], ids[4]]
    for node_id in ids:
        again.discard(node_id)
    StateDB.forget(tmp_path)
    assert dict(ApprovalBook(tmp_path).approved) == {}
    StateDB.forget(tmp_path)
    db_file = tmp_path / DB_FILE
    db_file.write_bytes(db_file.read_bytes()[:1000])  # cut short
    with pytest.raises(FleetStateError, match=f"{DB_FILE} is damaged"):
        ApprovalBook(tmp_path)
