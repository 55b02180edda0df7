"""The service's event feed and jobs: clients starting out get a snapshot, a waiting client wakes
on the next event, one that fell behind is told to re-read (reset), and jobs report their end."""

from __future__ import annotations

import asyncio
import json

import pytest

from console.fleet.service_events import EventFeed, JobNotFoundError, Jobs
from console.fleet_api.errors import FleetServiceError
from tests.support.asyncutil import run


def test_snapshot_then_events_then_reset():
    async def main():
        feed = EventFeed(lambda: [("records", {"agents": []}), ("health", {"status": "down"})], keep=3)
        first = await feed.poll(0, 5)
        assert [e.kind for e in first.events] == ["records", "health"] and first.next == 1 and not first.reset

        waiter = asyncio.create_task(feed.poll(first.next, 5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        feed.publish("token", {"token": "t1"})
        got = await asyncio.wait_for(waiter, 2)
        assert [(e.kind, e.data) for e in got.events] == [("token", {"token": "t1"})] and got.next == 2

        empty = await feed.poll(got.next, 0.05)  # nothing new: waits, answers empty
        assert empty.events == () and empty.next == 2

        for i in range(5):  # only 3 are kept: a client at seq 2 has missed some
            feed.publish("ring", {"i": i})
        behind = await feed.poll(2, 5)
        assert behind.reset and [e.kind for e in behind.events] == ["records", "health"] and behind.next == 7
        recent = await feed.poll(5, 5)
        assert [e.data["i"] for e in recent.events] == [3, 4] and not recent.reset

    run(main(), 30)


def test_jobs_report_results_errors_and_cancellation():
    async def main():
        feed = EventFeed()
        jobs = Jobs(feed)

        async def ok():
            return 41

        async def bad():
            raise FleetServiceError("the agents are not there")

        async def slow():
            await asyncio.sleep(30)

        done, failed, stuck = (jobs.start("a", ok(), to_json=lambda r: r + 1), jobs.start("b", bad(), ring="r1"),
                               jobs.start("c", slow()))
        await asyncio.sleep(0.05)
        assert jobs.get(done.id).to_json()["result"] == 42 and done.state == "done"
        assert failed.state == "failed" and failed.error == "the agents are not there" and failed.ring == "r1"
        jobs.cancel(stuck.id)
        await asyncio.sleep(0.05)
        assert stuck.state == "cancelled" and stuck.ended is not None
        assert (await feed.poll(0, 0)).events == ()  # this feed's snapshot is empty
        seen = [e.data["job"]["state"] for e in feed.since(1).events]
        assert sorted(seen) == sorted(["running"] * 3 + ["done", "failed", "cancelled"])
        with pytest.raises(JobNotFoundError):
            jobs.get("j999")
        await jobs.async_close()

    run(main(), 30)


def test_a_poll_answers_a_bounded_page_and_the_next_one_resumes_where_it_stopped():
    async def main():
        feed = EventFeed(lambda: [("records", {"agents": []})], keep=1000)
        start = (await feed.poll(0, 1)).next
        for i in range(30):
            feed.publish("hub", {"i": i, "pad": "x" * 1000})
        first = await feed.poll(start, 1, limit=10)
        assert [e.data["i"] for e in first.events] == list(range(10)) and first.more
        assert first.next == first.events[-1].seq

        page = json.loads(first.render(max_bytes=3000))  # ~1 KiB an event: cut after the third
        assert [e["data"]["i"] for e in page["events"]] == [0, 1, 2] and page["more"]
        assert page["next"] == page["events"][-1]["seq"] and not page["reset"]

        seen, after = [], start
        while True:
            got = json.loads((await feed.poll(after, 1, limit=7)).render(max_bytes=5000))
            seen += [e["data"]["i"] for e in got["events"]]
            after = got["next"]
            if not got["more"]:
                break
        assert seen == list(range(30)) and after == feed.last_seq  # nothing skipped, nothing twice

        snapshot = json.loads((await feed.poll(0, 1)).render(max_bytes=1))  # a snapshot goes whole
        assert len(snapshot["events"]) == 1 and not snapshot["more"]

    run(main(), 30)
