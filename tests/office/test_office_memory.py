"""A PC's memory limit, live in the emulated office: the agent of a memory-limited PC reports that
limit (not the machine's RAM) to the fleet service, and refuses a stage its free memory cannot hold
before fetching or loading it, with the memory the stage needs and the memory the PC has, where it
would otherwise have been OOM-killed. Real processes (the fleet service, two agents, their cgroups).
"""

from __future__ import annotations

import asyncio

import pytest

from engine.control.messages import Assignment
from tests.support.office.office import Office, OfficeError, OfficeSpec, building, leftovers, why_unavailable
from tests.support.office.pc import PcSpec

DESK_MB = 1024
SPEC = OfficeSpec(desks=(PcSpec("desk-1", cores=0.5, memory_mb=DESK_MB, display=False),
                         PcSpec("desk-2", cores=0.5, memory_mb=DESK_MB, display=False)),
                  server=PcSpec("server", cores=1.0, memory_mb=2048, display=False),
                  people=PcSpec("people", cores=0.5, memory_mb=512, display=False))
KV_POOL_MB = 64  # tests.support.office.office.AGENT_DEFAULTS
BELOW_MB = 24  # how far under the stage's need desk-2's free memory is set
_REASON = why_unavailable(SPEC)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=f"no emulated office here: {_REASON}")]


def _in_use(memory_dir) -> int:
    """What the group holds less the page cache it can drop (as the agent counts it)."""
    usage = int((memory_dir / "memory.usage_in_bytes").read_text())
    stat = dict(line.split() for line in (memory_dir / "memory.stat").read_text().splitlines())
    return usage - int(stat.get("total_inactive_file", 0)) - int(stat.get("total_active_file", 0))


def test_a_memory_limited_pc_reports_its_limit_and_refuses_a_stage_that_would_not_fit(tmp_path, tiny_export):
    export = tiny_export("llama", 2)
    manifest = (export / "manifest.json").read_text()
    from agent.service.worker_launch import stage_memory_need

    def need_of(stage: int) -> int:
        probe = Assignment.create(manifest, export_id="x", stage=stage, source="", listen_port=1, next_hop="")
        return stage_memory_need(probe, kv_pool_mb=KV_POOL_MB)[0]

    async def scenario(pcs) -> None:
        async with Office(pcs, tmp_path) as office:
            await office.async_start_fleet()
            agents = await office.async_enrol(timeout=150)
            await office.admin.call("POST", "/agents/refresh")
            for name in agents:
                record = await office.async_agent(name)
                assert record["memory_bytes"] == DESK_MB << 20, (name, record["memory_bytes"])
                inventory = record["status"]["inventory"]
                assert inventory["ram_total"] == DESK_MB << 20, inventory
                assert inventory["ram_available"] < DESK_MB << 20, inventory

            d1, d2 = office.desks
            memory = d2.group.dirs["memory"]
            limit = _in_use(memory) + need_of(1) - (BELOW_MB << 20)
            (memory / "memory.limit_in_bytes").write_text(str(limit))
            with pytest.raises(OfficeError) as refused:
                await office.async_place(export, [d1, d2], timeout=180)
            message = str(refused.value)
            assert f"needs {need_of(1) >> 20} MiB of memory" in message, message
            assert "MiB free of its" in message and "not loaded" in message, message
            report = d2.group.memory_report()
            assert report["oom_kills"] == 0, report  # refused, never OOM-killed
            assert office.agents["desk-2"].poll() is None, "desk-2's agent still runs"

    with building(SPEC, tmp_path) as pcs:
        asyncio.run(asyncio.wait_for(scenario(pcs), 300))
    assert leftovers() == []
