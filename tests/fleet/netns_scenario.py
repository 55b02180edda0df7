"""The console's side of the multi-host test, run inside the console's network namespace by
tests/fleet/test_netns.py: ``python -m tests.fleet.netns_scenario CONFIG.json``.

It hosts the fleet (CA, tokens, enrollment, hub), starts one headless agent per other host (in
that host's namespace, via ``ip netns exec``) with a join token, finds them over mDNS, approves
them, places the tiny model, distributes it, asks the ring for a greedy answer, kills the agent
serving the last stage half-way through a second answer, and reports what happened as one JSON
line on stdout (progress lines go to stderr).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from console.fleet.distribution import Distributor
from console.fleet.fleet import FleetModel
from console.fleet.ring_layout import AgentEndpoint, RingLayout
from engine.control.fleet_services import fleet_host, write_token_file
from engine.control.messages import WorkerSettings
from engine.discovery.mdns import Browser
from engine.generation.in_process import greedy_generate
from engine.generation.request import GenerationRequest
from engine.shards.stage import LocalChain
from engine.tools.wan_emulator import WanProxy
from engine.wire.address import Address
from tests.support.asyncutil import until

N = 24
LINK_DELAY_MS = 5.0  # each way, on the console's hops into and out of the ring (user-space emulation)


def say(text: str) -> None:
    print(f"[console] {text}", file=sys.stderr, flush=True)


async def main(cfg: dict) -> dict:
    state = Path(cfg["state"])
    me = cfg["console"]["address"]
    agents_cfg = cfg["agents"]
    result: dict = {"steps": []}
    async with fleet_host(state / "console", host=me) as host:
        fleet = FleetModel(state / "console", host.credentials)
        detach = fleet.attach_hub(host.hub)
        browser = Browser(me, fleet.update_peers)
        await browser.async_start()
        procs: dict[str, subprocess.Popen] = {}
        try:
            env = {**os.environ, "DESKFLEET_KEYRING_DIR": str(state / "keyring")}
            for a in agents_cfg:
                argv = ["ip", "netns", "exec", a["ns"], sys.executable, "-m", "engine.cli.main", "agent", "--headless",
                        "--state-dir", str(state / a["ns"]), "--interface", a["address"], "--control-port", "7210",
                        "--data-port", "7211",
                        "--join-file", str(write_token_file(state / f"{a['ns']}.token", host.token())),
                        "--console", host.enrollment]
                procs[a["address"]] = subprocess.Popen(argv, env=env,
                                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                       start_new_session=True)
            # discover: every agent, joined, seen over mDNS from another namespace
            want = {a["address"] for a in agents_cfg}
            await until(lambda: want <= {r.address for r in fleet.records() if r.node_id and r.state == "idle"},
                        "every agent to be discovered over mDNS, joined", 90)
            result["steps"].append("discovered")
            records = {r.address: r for r in fleet.records() if r.address in want}
            for r in records.values():
                fleet.approve(r.node_id)
            result["steps"].append("approved")
            say(f"approved {sorted(records)}")

            # place: stage 0 in the console, stages 1 and 2 on the first two agents; the third stands by
            ring_hosts = [a["address"] for a in agents_cfg[:2]]
            standby_host = agents_cfg[2]["address"] if len(agents_cfg) > 2 else None
            layout = RingLayout.of([(records[h].control_address, i + 1) for i, h in enumerate(ring_hosts)])
            export = Path(cfg["export"])
            reference = greedy_generate(LocalChain.load(cfg["reference"], exact=True), tuple(cfg["prompt"]), N,
                                        ignore_eos=True).tokens
            options = {}
            if standby_host is not None and "standby" in Distributor.__init__.__code__.co_varnames:
                options["standby"] = [AgentEndpoint(records[standby_host].control_address)]
            proxies: list[WanProxy] = []

            async def delayed(target: Address) -> Address:
                proxy = WanProxy(Address(me, 0), target, delay_ms=LINK_DELAY_MS)
                proxies.append(proxy)
                return await proxy.async_start()

            async with Distributor(host, export, layout, console_host=me, worker=WorkerSettings(exact=True, threads=1),
                                   data_hop=delayed, **options) as dist:
                health = await dist.async_run()
                result["steps"].append("distributed")
                result["health_ok"] = health.ok
                coordinator = dist.coordinator
                first = [e.token_id async for e in coordinator.stream(
                    GenerationRequest(tuple(cfg["prompt"]), N, ignore_eos=True))]
                result["first_answer_identical"] = tuple(first) == reference
                result["steps"].append("answered")
                if "standby" in options:
                    got = []
                    killed_at = None
                    async for event in coordinator.stream(GenerationRequest(tuple(cfg["prompt"]), N, ignore_eos=True)):
                        got.append(event.token_id)
                        if len(got) == N // 2:
                            victim = procs[ring_hosts[-1]]
                            os.killpg(victim.pid, signal.SIGKILL)  # the PC is unplugged: agent and worker
                            killed_at = time.monotonic()
                            say(f"killed the agent on {ring_hosts[-1]}")
                    result["after_kill_identical"] = tuple(got) == reference
                    result["recovery_s"] = time.monotonic() - killed_at if killed_at else None
                    result["failovers"] = coordinator.metrics().get("failovers_total", 0)
                    result["steps"].append("survived a lost agent")
                result["ring_step_ms"] = coordinator.metrics().get("ring_step_ms_avg")
            for proxy in proxies:
                await proxy.async_close()
        finally:
            await browser.async_close()
            detach()
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    return result


if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(asyncio.run(main(config))), flush=True)
