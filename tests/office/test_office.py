"""The emulated office, short (CI's slow lane): a fleet service, three desk PCs and the people's PC,
each its own network namespace, cgroups (½ core and 1.5 GB per desk) and, for a desk, its own X
display; all real processes. The service finds the agents over mDNS and a 2-stage ring of the tiny
model serves across two desks; people ask through the real openai client, directly and over a
delayed link; someone sits down at the third desk (xdotool, at its X server) and its agent pauses;
and nothing of the run remains afterwards. Correctness only: no speed is asserted.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.support.office.link import wan_link
from tests.support.office.office import Office, OfficeSpec, building, leftovers, why_unavailable
from tests.support.office.pc import PcSpec
from tests.support.office.person import Person
from tests.support.office.users import ask

DESK_MB = 1536
SPEC = OfficeSpec(desks=tuple(PcSpec(f"desk-{i}", cores=0.5, memory_mb=DESK_MB) for i in (1, 2, 3)),
                  server=PcSpec("server", cores=1.0, memory_mb=2048, display=False),
                  people=PcSpec("people", cores=0.5, memory_mb=1024, display=False, cable_mbit=100))
LINK_DELAY_MS = 40.0
IN_USE = "the PC is in use"  # agent.service.pause.IN_USE
_REASON = why_unavailable(SPEC)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=f"no emulated office here: {_REASON}")]


async def _until(check, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.5)


def test_an_office_of_three_desks_serves_pauses_for_a_person_and_leaves_nothing(tmp_path, tiny_export):
    export = tiny_export("llama", 2)
    seen: dict = {}

    async def scenario(pcs) -> None:
        async with Office(pcs, tmp_path) as office:
            await office.async_start_fleet()
            agents = await office.async_enrol(timeout=150)
            assert set(agents) == {"desk-1", "desk-2", "desk-3"}
            assert all("mdns" in a["sources"] for a in agents.values()), agents  # found on the LAN, not told
            d1, d2, d3 = office.desks
            ring = await office.async_place(export, [d1, d2])
            assert ring["phase"] == "serving", ring

            # each desk's stage worker runs inside the desk: its cgroups, its one CPU (½ core of it)
            for desk in (d1, d2):
                pids = desk.group.pids()
                assert len(pids) >= 3, f"{desk.name}: Xvfb, agent and worker expected in its cgroup, got {pids}"
                assert all(os.sched_getaffinity(p) == set(desk.cpus) for p in pids if os.path.exists(f"/proc/{p}"))
                assert desk.group.memory_report()["limit_bytes"] == DESK_MB << 20

            url, key, ca = await office.async_api()
            direct = await asyncio.to_thread(ask, office.people, url, key, users=2, max_tokens=12, ca_file=ca)
            assert all(direct.completion_tokens) and all(t.strip() for t in direct.texts), direct
            api = url.split("//", 1)[1].split("/", 1)[0]
            with wan_link(office.people.host, api, 18080, delay_ms=LINK_DELAY_MS, log=tmp_path / "wan.log") as hop:
                far = await asyncio.to_thread(ask, office.people, f"https://{hop.listen}/v1", key, users=1,
                                              max_tokens=12, ca_file=ca, host_header=api)
            assert far.texts[0] == direct.texts[0], "the same greedy answer over the delayed link"
            assert far.seconds >= 2 * LINK_DELAY_MS / 1000  # it did cross the link (a lower bound, not a speed)

            agent3 = await office.async_agent("desk-3")
            assert agent3["state"] == "idle" and not agent3["paused_reasons"], agent3
            await asyncio.to_thread(Person(d3.display).work, 3.0)

            async def paused():
                await office.admin.call("POST", "/agents/refresh")
                a = await office.async_agent("desk-3")
                return a if a["state"] == "paused" else None

            a3 = await _until(paused, "desk-3's agent to report it paused for its person", 30)
            assert IN_USE in a3["paused_reasons"], a3
            assert (await office.async_agent("desk-1"))["state"] != "paused"
            seen["pids"] = [p for pc in pcs for p in pc.group.pids()]
            seen["displays"] = [pc.display.pid for pc in pcs if pc.display is not None]

    with building(SPEC, tmp_path) as pcs:
        asyncio.run(asyncio.wait_for(scenario(pcs), 240))
    assert leftovers() == []
    alive = [p for p in seen["pids"] + seen["displays"] if os.path.exists(f"/proc/{p}")]
    assert not alive, f"processes of the office still run: {alive}"
