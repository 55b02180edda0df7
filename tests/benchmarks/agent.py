"""``python -m tests.benchmarks agent``: what the agent costs a PC when it is idle, and how fast it
steps aside when the person at the PC touches it.

- footprint: a joined, idle agent process (headless, and the tray app under the offscreen Qt
  platform) measured side by side over the same window: CPU time as % of one core, RSS at the
  end and peak (process + children). Targets: < 0.5 % of a core, < 150 MB.
- pause: the agent serves stage 1 of the default model (2 x INT4) in a paged ring whose
  coordinator (stage 0 in this process) generates continuously; a keystroke (the idle fake)
  must release the worker's cores (its process gone) within 2 s. Then the PC goes idle and the
  time until the worker serves again is measured. Several rounds, medians and maxima.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from engine.cli.main import Command
from tests.benchmarks.record import machine_info, markdown_table, median, update_section, write_json
from tests.support.loopback import free_port

COMMAND_LINE = "python -m tests.benchmarks agent"
CPU_TARGET_PCT = 0.5
RSS_TARGET_MB = 150
PAUSE_TARGET_S = 2.0
POOL_BYTES = 64 << 20  # the ring's KV pool per stage: ~5,000 tokens of the default model, one stream's worth
DECODE_TOKENS = 4_000  # the stream decoding through the agent's worker when the keystroke comes (~1.5 s in)


def configure(p: argparse.ArgumentParser) -> None:
    from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR

    p.add_argument("--seconds", type=float, default=60.0, help="footprint window (default 60)")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to let the agents settle first (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="pause/resume rounds (default 5)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "agent.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return [proc, *proc.children(recursive=True)]
    return []


def _cpu_s(proc: psutil.Process) -> float:
    total = 0.0
    for p in _tree(proc):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _rss(proc: psutil.Process) -> int:
    total = 0
    for p in _tree(proc):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


async def _async_footprint(seconds: float, settle: float, work: Path) -> dict[str, Any]:
    from engine.control.fleet_services import fleet_host, write_token_file

    async with fleet_host(work / "console") as con:
        env = {**os.environ, "DESKFLEET_KEYRING_DIR": str(work / "keyring"), "QT_QPA_PLATFORM": "offscreen"}
        variants = {"headless": ["--headless"], "tray": []}
        procs: dict[str, asyncio.subprocess.Process] = {}
        for name, extra in variants.items():
            procs[name] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "engine.cli.main", "agent", *extra, "--state-dir", str(work / name),
                "--interface", "127.0.0.1", "--control-port", "0", "--data-port", "0",
                "--join-file", str(write_token_file(work / f"{name}.token", con.token())), "--console", con.enrollment,
                env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            await asyncio.sleep(settle)
            handles = {n: psutil.Process(p.pid) for n, p in procs.items()}
            for name, p in procs.items():
                if p.returncode is not None:
                    raise RuntimeError(f"the {name} agent exited early with code {p.returncode}")
            cpu0 = {n: _cpu_s(h) for n, h in handles.items()}
            peak = {n: 0 for n in handles}
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                await asyncio.sleep(1.0)
                for n, h in handles.items():
                    peak[n] = max(peak[n], _rss(h))
            elapsed = time.monotonic() - t0
            out = {}
            for n, h in handles.items():
                out[n] = {"cpu_pct_of_core": 100 * (_cpu_s(h) - cpu0[n]) / elapsed,
                          "rss_mb": _rss(h) / 1e6, "peak_rss_mb": peak[n] / 1e6, "seconds": elapsed}
            return out
        finally:
            for p in procs.values():
                if p.returncode is None:
                    p.terminate()
            for p in procs.values():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(p.wait(), 30)


async def _async_pause_rounds(rounds: int, work: Path) -> dict[str, Any]:
    from agent.service.idle import FakeIdle
    from agent.service.service import AgentService
    from agent.service.settings import AgentSettings
    from engine.control.client import ControlClient
    from engine.control.fleet_services import fleet_host
    from engine.control.messages import Assignment, WorkerSettings
    from engine.generation.request import GenerationRequest
    from engine.trust.peer_policy import PeerPolicy
    from engine.wire.address import Address
    from tests.benchmarks.kit import default_model_exports
    from tests.support.paged_ring import paged_ring, paged_stage0

    _, (export,), _ = default_model_exports(("int4", 2, True))
    idle = FakeIdle(1e6)
    settings = AgentSettings(name="bench", interface="127.0.0.1", control_port=0, data_port=0,
                             resume_after_idle_s=0.5)
    pauses, resumes = [], []
    async with fleet_host(work / "console", {"default-2": export}) as con:
        agent = AgentService(work / "agent", settings, idle_source=idle, power=lambda: None)
        await agent.async_start()
        try:
            await agent.async_join(con.enrollment, con.token())
            client = ControlClient(con.credentials, "127.0.0.1", agent.control_port)
            data_port = free_port()
            await client.async_assign(Assignment.create(
                (export / "manifest.json").read_text(), export_id="default-2", stage=1,
                source=con.hub.shard_url("default-2"), listen_port=data_port, next_hop="127.0.0.1:9",
                worker=WorkerSettings(threads=1), runtime="paged", expect_upstream=(con.credentials.node_id,),
                expect_next=con.credentials.node_id))  # the console is both of its neighbours
            con.hub.grant(client.peer_node_id, "default-2", [1])
            await client.async_fetch()
            await client.async_wait_for(lambda s: s.fetch.finished, 300, "the shard fetch")
            await client.async_start_worker()
            await agent.async_wait_worker_ready(300)
            stage0 = await asyncio.to_thread(paged_stage0, export, pool_bytes=POOL_BYTES, num_threads=1)
            for _ in range(rounds):
                return_port = free_port()
                await client.async_assign(replace(agent.assignment, next_hop=f"127.0.0.1:{return_port}"))
                await client.async_start_worker()
                await agent.async_wait_worker_ready(300)
                async with paged_ring(export, stage0, Address("127.0.0.1", data_port),
                                      Address("127.0.0.1", return_port), server_ssl=con.credentials.server_context(),
                                      client_ssl=con.credentials.client_context(), dial_deadline=30,
                                      peers=PeerPolicy.of([client.peer_node_id], client.peer_node_id)) as coordinator:
                    async def generate():
                        with contextlib.suppress(Exception):  # it ends when the worker steps aside
                            async for _ in coordinator.stream(GenerationRequest((1, 2, 3, 4), DECODE_TOKENS,
                                                                                ignore_eos=True)):
                                pass

                    busy = asyncio.create_task(generate())
                    await asyncio.sleep(1.5)  # decoding: the worker's core is busy
                    proc = psutil.Process(agent.worker_pid)
                    idle.seconds = 0.0
                    touched = time.monotonic()
                    await asyncio.to_thread(proc.wait, 30)
                    pauses.append(time.monotonic() - touched)
                    busy.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await busy
                idle.seconds = 1e6
                went_idle = time.monotonic()
                await agent.async_wait_worker_ready(300)
                resumes.append(time.monotonic() - went_idle)
        finally:
            await agent.async_close()
    return {"pause_s": pauses, "resume_s": resumes}


def _machine(m: dict[str, Any]) -> str:
    load = ", ".join(str(x) for x in m.get("load_average", ()))
    return f"{m.get('cores')} cores, {m.get('memory_gb')} GB, load average {load}, {m.get('date')}"


def render(result: dict[str, Any], json_path: Path) -> str:
    fp = result["footprint"]
    rows = [[name, f"{v['cpu_pct_of_core']:.2f} %", f"{v['rss_mb']:.0f} MB", f"{v['peak_rss_mb']:.0f} MB",
             "met" if v["cpu_pct_of_core"] < CPU_TARGET_PCT else "**missed**",
             "met" if v["peak_rss_mb"] < RSS_TARGET_MB else "**missed**"] for name, v in fp.items()]
    p = result["pause"]
    pause_rows = [["keystroke -> worker gone (cores released)", f"{median(p['pause_s']):.2f} s",
                   f"{max(p['pause_s']):.2f} s", f"<= {PAUSE_TARGET_S:.0f} s",
                   "met" if max(p["pause_s"]) <= PAUSE_TARGET_S else "**missed**"],
                  ["idle again -> worker serving", f"{median(p['resume_s']):.2f} s", f"{max(p['resume_s']):.2f} s",
                   "within seconds", "met" if max(p["resume_s"]) < 10 else "**missed**"]]
    return "\n".join([
        f"Command: `{COMMAND_LINE}` · raw results: `{json_path.as_posix()}` · {_machine(result['machine'])}",
        "",
        f"Idle footprint over {fp['headless']['seconds']:.0f} s (joined, not serving; process + children; "
        f"targets < {CPU_TARGET_PCT} % of a core, < {RSS_TARGET_MB} MB):",
        "",
        markdown_table(["agent", "CPU", "RSS at end", "peak RSS", "CPU target", "RSS target"], rows),
        "",
        f"Stepping aside ({len(p['pause_s'])} rounds; the agent serves stage 1 of the default model, 2 x INT4, "
        "while a paged coordinator decodes through it):",
        "",
        markdown_table(["transition", "median", "max", "target", "verdict"], pause_rows),
    ])


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="deskfleet-bench-agent-") as tmp:
        work = Path(tmp)
        os.environ["DESKFLEET_KEYRING_DIR"] = str(work / "keyring")  # never the real keyring
        footprint = asyncio.run(_async_footprint(args.seconds, args.settle, work / "footprint"))
        pause = asyncio.run(_async_pause_rounds(args.rounds, work / "pause"))
    result = {"benchmark": "agent", "command": COMMAND_LINE, "machine": machine_info(), "footprint": footprint,
              "pause": pause}
    write_json(args.json, result)
    update_section(args.doc, "agent", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="agent", help="agent footprint when idle and time to step aside on user input",
                  configure=configure, run=run)
