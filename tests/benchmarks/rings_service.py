"""The rings benchmark's fleet-service phase: ``deskfleet fleet`` as a real process on loopback
with two real agents (in this process; their stage workers are processes) serving one 2-stage
ring of the export; the service is SIGKILLed and started again on its state dir, and the time
from that restart to the first answer is measured (it re-forms the ring from the state database,
the agents keep their workers); then the idle service's CPU and RSS. The harness is the fleet
service's own restart test's (:class:`tests.support.service_process.ServiceProcess`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

FIRST_ANSWER_TIMEOUT_S = 900.0


async def _ask(api_url: str, key: str) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=api_url, api_key=key, max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                             max_tokens=1, temperature=0)


async def _async_measure(export: Path, root: Path, idle_seconds: float) -> dict[str, Any]:
    import psutil

    from engine.envvars import KEYRING_DIR
    from engine.shards.manifest import load_manifest
    from tests.support.console_fleet_helpers import agent
    from tests.support.service_process import ServiceProcess, ring_serving

    os.environ.setdefault(KEYRING_DIR, str(root / "keyring"))  # never the user's keyring
    stages = load_manifest(export).stages
    if len(stages) != 2:
        raise SystemExit(f"the fleet-service phase serves a 2-stage export; {export} has {len(stages)} stages")
    state = root / "fleet"
    (state / "exports").mkdir(parents=True)
    shutil.copytree(export, state / "exports" / export.name)
    service = ServiceProcess(state, root / "service.log")
    pcs = [agent(root, name, warm_spare="off") for name in ("desk-a", "desk-b")]
    admin = None
    try:
        admin = await service.start(timeout=120)
        token = (await admin.ok("POST", "/tokens", {}))["token"]
        enrollment = (await admin.ok("GET", "/service"))["enrollment"]
        nodes = []
        for pc in pcs:
            await pc.async_start()
            await pc.async_join(enrollment, token)
            token = (await admin.ok("POST", "/tokens", {}))["token"]
            added = (await admin.ok("POST", "/agents", {"host": "127.0.0.1", "port": pc.control_port}))["agent"]
            await admin.ok("POST", f"/agents/{added['key']}/approve")
            nodes.append(added["node_id"])
        plan = {"stages": [{"device_id": f"{node}/CPU", "pc_id": node, "first_layer": st.first_layer,
                            "last_layer": st.last_layer} for node, st in zip(nodes, stages, strict=True)]}
        made = await admin.ok("POST", "/rings", {"plan": plan, "export_id": export.name})
        job = await admin.job(made["job"]["id"], FIRST_ANSWER_TIMEOUT_S)
        if job["state"] != "done":
            raise RuntimeError(f"the fleet service did not bring its ring up: {job}")
        ring = made["ring"]["ring"]
        api_url = (await admin.ok("GET", "/service"))["api_url"]
        key = (await admin.ok("POST", "/keys/console/secret"))["secret"]
        await _ask(api_url, key)
        await admin.close()
        admin = None
        await service.kill()
        killed = time.perf_counter()
        admin = await service.start(timeout=120)
        started_s = time.perf_counter() - killed
        await ring_serving(admin, ring, FIRST_ANSWER_TIMEOUT_S)
        await _ask(api_url, key)
        restart_s = time.perf_counter() - killed
        assert service.proc is not None
        proc = psutil.Process(service.proc.pid)
        await asyncio.sleep(1.0)
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
        await asyncio.sleep(idle_seconds)
        cpu1, elapsed = sum(proc.cpu_times()[:2]), time.perf_counter() - t0
        return {"restart_to_admin_s": started_s, "restart_to_first_answer_s": restart_s, "idle_seconds": elapsed,
                "idle_cpu_pct": 100 * (cpu1 - cpu0) / elapsed, "rss_mb": proc.memory_info().rss / 2**20}
    finally:
        if admin is not None:
            await admin.close()
        await service.stop()
        for pc in pcs:
            await asyncio.wait_for(pc.async_close(), 60)


def measure_fleet_restart(export: Path, root: Path, idle_seconds: float) -> dict[str, Any]:
    """The fleet service killed and restarted: seconds to its first answer, then its idle CPU and RSS."""
    return asyncio.run(asyncio.wait_for(_async_measure(export, root, idle_seconds), 3 * FIRST_ANSWER_TIMEOUT_S))
