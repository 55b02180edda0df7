"""A joined PC cannot fill the fleet service or freeze it through the hub (issue 29, H1).

The review's reproduction: a PC joined with a token (not approved) posted 300 events of ~1 MB
to the hub's ``/v1/events``; the service kept them all, republished each on the admin feed, and
one feed poll then answered 299 MB in 57 s while the OpenAI API's ``/health`` waited 55 s.
Here the insider does it again on loopback, against a real fleet service, with the certificate a
real join gave it, over real mutual TLS: the hub refuses the large bodies (413 naming the limit)
and the flood beyond the member's rate (429), holds a bounded number of bytes for it, the feed
answers in bounded pages, ``/health`` answers meanwhile, and a fellow member's reports still
arrive. The eviction policy itself (a member over its share loses only its own) is unit-tested
in tests/control/test_hub_events.py.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from console.fleet.service_events import MAX_PAGE_BYTES
from engine.control.enrollment import async_join
from engine.control.hub_events import (
    EVENT_BURST,
    MAX_BYTES_PER_MEMBER,
    MAX_EVENT_BODY_BYTES,
    MAX_HELD_BYTES,
)
from tests.fleet_service.conftest import service_in_process
from tests.support.asyncutil import run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_keyring")]

HANG_GUARD_S = 30.0  # generous: the review's /health took 55 s; a healthy one takes milliseconds


def _held(events) -> int:
    """Bytes of the bodies the hub holds, measured the same way before and after the fix."""
    return sum(len(json.dumps(e.body)) for e in events)


async def _post(session: aiohttp.ClientSession, url: str, body: bytes, ssl) -> tuple[int, str]:
    try:
        async with session.post(url, data=body, ssl=ssl, headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.text()
    except aiohttp.ClientError as exc:  # the hub answered 413 and closed before taking the whole body
        return -1, str(exc)


async def _feed_pages(admin: aiohttp.ClientSession, after: int) -> tuple[list[dict], list[int]]:
    """Every feed event after ``after``, page by page as the console reads it; each page's size."""
    events, sizes = [], []
    while True:
        async with admin.get("http://local/admin/v1/events", params={"after": str(after), "timeout": "0"}) as resp:
            assert resp.status == 200
            raw = await resp.read()
        page = json.loads(raw)
        sizes.append(len(raw))
        events += page["events"]
        after = page["next"]
        if not page.get("more"):
            return events, sizes


def test_a_member_flooding_the_hub_is_bounded_and_the_service_keeps_answering(tmp_path):
    async def main():
        async with service_in_process(tmp_path / "fleet") as service:
            hub = service.host.hub
            mallory = (await async_join(service.host.enrollment, service.new_token()["token"], "mallory")).credentials
            alice = (await async_join(service.host.enrollment, service.new_token()["token"], "alice")).credentials
            as_mallory, as_alice = mallory.client_context(), alice.client_context()  # one pool of connections each
            health_url = f"http://127.0.0.1:{service.api.port}/health"
            admin = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(service.settings.state_dir
                                                                                   / "admin.sock")))
            members = aiohttp.ClientSession()
            try:
                async with admin.get("http://local/admin/v1/events", params={"after": "0"}) as resp:
                    start = (await resp.json())["next"]
                status, _ = await _post(members, hub.events_url, json.dumps(
                    {"event": "paused", "reasons": ["user-active"], "stage": 0}).encode(), as_alice)
                assert status == 200

                # ~1 MB events of 60,000 small keys, as in the review, and /health asked meanwhile
                huge = json.dumps({"event": "paused", "reasons": ["x"],
                                   **{f"k{i}": i for i in range(60_000)}}).encode()
                assert len(huge) > 900_000
                flood = [asyncio.create_task(_post(members, hub.events_url, huge, as_mallory))
                         for _ in range(20)]
                async with aiohttp.ClientSession() as probe:
                    async with asyncio.timeout(HANG_GUARD_S):
                        async with probe.get(health_url) as resp:
                            assert resp.status in (200, 503)  # no ring here: "down" is the honest answer
                            await resp.read()
                answers = await asyncio.gather(*flood)
                assert all(s in (413, -1) for s, _ in answers), [s for s, _ in answers]
                assert any(s == 413 and str(MAX_EVENT_BODY_BYTES) in text for s, text in answers), answers[:3]

                # just under the body limit, with junk fields: beyond its burst the member is refused
                padded = json.dumps({"event": "paused", "reasons": ["r" * 60] * 20, "detail": "d" * 1500,
                                     "junk": "j" * 1000}).encode()
                assert len(padded) < MAX_EVENT_BODY_BYTES
                statuses = [(await _post(members, hub.events_url, padded, as_mallory))[0]
                            for _ in range(60)]
                assert statuses.count(200) <= EVENT_BURST + 2 and statuses.count(429) >= 60 - EVENT_BURST - 2

                mine = hub.events.of(mallory.node_id)
                assert all("junk" not in e.body and len(e.body["detail"]) <= 256 for e in mine)
                assert _held(mine) <= MAX_BYTES_PER_MEMBER
                assert _held(hub.events) <= MAX_HELD_BYTES and hub.events.held_bytes <= MAX_HELD_BYTES

                status, _ = await _post(members, hub.events_url, json.dumps(
                    {"event": "resumed", "reasons": []}).encode(), as_alice)
                assert status == 200  # a fellow member's report still gets in, and is still held
                assert [e.event for e in hub.events.of(alice.node_id)] == ["paused", "resumed"]

                events, sizes = await _feed_pages(admin, start)
                assert max(sizes) <= MAX_PAGE_BYTES + MAX_EVENT_BODY_BYTES
                hub_news = [(e["data"]["node_id"], e["data"]["event"]) for e in events if e["kind"] == "hub"]
                assert (alice.node_id, "paused") in hub_news and (alice.node_id, "resumed") in hub_news
                assert all("junk" not in e["data"]["body"] for e in events if e["kind"] == "hub")
                async with admin.get("http://local/admin/v1/events",
                                     params={"after": str(start), "timeout": "0", "limit": "3"}) as resp:
                    page = await resp.json()
                assert len(page["events"]) == 3 and page["more"] and page["next"] == page["events"][-1]["seq"]
            finally:
                await members.close()
                await admin.close()

    run(main(), 300)
