"""The simulated fleet (tests/support/sim_fleet) against a real fleet service: 40 fake agents in
two worker processes join with single-use tokens (real enrolment, mutual TLS), register at the
hub, are approved through the admin API, pause and resume at random, and are paused, resumed
and removed by the admin; the service's records must agree with what the agents did. Then 8
more join with one reusable auto-approving token, and are approved with no call at all."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent.service import pause
from console.fleet_api.agent_record import Membership
from tests.fleet_service.conftest import service_in_process
from tests.support.sim_fleet import SimFleet

N = 40


async def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.2)
    return result


@pytest.mark.slow
def test_a_simulated_fleet_joins_registers_pauses_and_the_service_agrees(tmp_path, private_keyring):
    async def main() -> None:
        async with service_in_process(tmp_path / "fleet") as service:
            fleet = service.fleet
            sim = SimFleet(tmp_path / "fleet", agents=N, processes=2, flap_per_s=8.0, register_s=2.0,
                           prefix=f"simt{time.time_ns() % 10**6}")
            async with sim:
                ours = set(sim.stats.joined.values())
                assert len(ours) == N and not sim.stats.join_failed  # N distinct node ids: N keys, N certificates
                # a registration names no PC: its name comes with the first status poll (every 0.5 s here)
                await _until(lambda: sum(1 for r in fleet.records() if r.node_id in ours and r.status) == N, 20,
                             "every agent polled")
                records = {r.node_id: r for r in fleet.records() if r.node_id in ours}
                assert len(records) == N
                for name, node_id in sim.stats.joined.items():
                    record = records[node_id]
                    assert record.approved and record.verified and record.membership is Membership.MEMBER
                    assert record.name == name  # the name the agent joined and answers its polls with
                # every agent registers again at its interval and is polled over mutual TLS
                await _until(lambda: len(sim.stats.registered) >= 2 * N and sim.stats.total_polls >= 2 * N, 30,
                             "re-registrations and status polls")
                assert sim.stats.register_failed == 0 and not sim.stats.errors
                await _until(lambda: sim.stats.total_flaps >= 20, 30, "random pauses and resumes")

                # the fleet settles: what the service shows is what each agent is
                sim.set_flap_rate(0.0)
                by_node = {v: k for k, v in sim.stats.joined.items()}

                def agrees() -> bool:
                    paused_shown = {by_node[r.node_id] for r in fleet.records() if r.node_id in ours
                                    and r.state == "paused"}
                    return paused_shown == sim.stats.paused_names

                await asyncio.sleep(1.5)  # the workers' last flaps reported
                await _until(agrees, 15, "the service's paused agents to match the simulated ones")
                assert 0 < len(sim.stats.paused_names) < N  # random flaps left some paused, not all

                # the admin pauses and resumes an agent through the service: the agent gets the order
                name = next(n for n in sim.names if n not in sim.stats.paused_names)
                node_id = sim.stats.joined[name]
                await sim.admin.async_pause(node_id)
                await _until(lambda: (name, True) in sim.stats.remote, 10, "the console's pause at the agent")
                assert fleet.get(node_id).state == "paused" and pause.REMOTE in fleet.get(node_id).paused_reasons
                await sim.admin.async_resume(node_id)
                await _until(lambda: (name, False) in sim.stats.remote, 10, "the console's resume at the agent")
                await _until(lambda: fleet.get(node_id).state == "idle", 10, "the resumed agent shown idle")

                # a removed agent is refused at the hub from then on; the others are not
                await sim.admin.async_remove(node_id)
                failed = sim.stats.register_failed
                await _until(lambda: sim.stats.register_failed > failed, 15, "the removed agent's registration refused")
                assert node_id not in {r.node_id for r in fleet.records()}
                assert len([r for r in fleet.records() if r.node_id in ours and r.approved]) == N - 1

                # one token of 8 uses, auto-approving: 8 PCs enrolled and approved without a click
                more = SimFleet(tmp_path / "fleet", agents=8, tokens="reusable", prefix=f"{sim.prefix}r")
                async with more:
                    theirs = set(more.stats.joined.values())
                    assert len(theirs) == 8 and not theirs & ours
                    assert all(fleet.get(n).approved for n in theirs)
                    listing = await more.admin.async_call("GET", "/tokens")
                    (used,) = [t for t in listing["tokens"] if t.get("label") == f"{more.prefix} fleet"]
                    assert used["used"] == 8 and {a["node_id"] for a in used["admitted"]} == theirs

    asyncio.run(main())
