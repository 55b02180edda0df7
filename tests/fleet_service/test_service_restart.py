"""The fleet service as a real process on loopback, with two real agents (in this process, their
stage workers real processes): it serves a 2-stage ring of the tiny model through its OpenAI API,
is SIGKILLed mid-life, and started again on the same state dir re-forms the ring with no admin
action and answers the same greedy tokens. Every wait is bounded (a hang fails the test)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import openai
import pytest

from engine.shards.manifest import load_manifest
from tests.conftest import PROMPT_IDS
from tests.fleet_service.admin import Admin
from tests.support.console_fleet_helpers import agent
from tests.support.loopback import free_port

N = 12
pytestmark = pytest.mark.usefixtures("private_keyring")


class ServiceProcess:
    """``deskfleet fleet`` on a state dir with fixed loopback ports (as a real install has)."""

    def __init__(self, state: Path, log: Path) -> None:
        self.state, self.log = state, log
        self.ports = {"--api-port": free_port(), "--enrollment-port": free_port(), "--hub-port": free_port(),
                      "--data-port": free_port()}
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 60.0) -> Admin:
        args = [sys.executable, "-m", "engine.cli.main", "fleet", "--state-dir", str(self.state),
                "--interface", "127.0.0.1", "--admin-port", "-1", "--threads", "1", "--exact"]
        for flag, port in self.ports.items():
            args += [flag, str(port)]
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(*args, stdout=out, stderr=out,
                                                             stdin=asyncio.subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.returncode is None, f"the service exited {self.proc.returncode}:\n{self.log.read_text()}"
            if (self.state / "fleet-service.json").exists():
                admin = Admin.unix(self.state / "admin.sock")
                with contextlib.suppress(OSError, Exception):
                    await admin.ok("GET", "/service", timeout=5)
                    return admin
                await admin.close()
            assert time.monotonic() < deadline, f"the service did not start in {timeout:g} s:\n{self.log.read_text()}"
            await asyncio.sleep(0.2)

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.proc.wait(), 10)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _ask(api_url: str, key: str, model: str) -> str:
    async with openai.AsyncOpenAI(base_url=api_url, api_key=key, max_retries=0, timeout=60) as client:
        completion = await client.completions.create(model=model, prompt=list(PROMPT_IDS), max_tokens=N,
                                                     temperature=0)
    return completion.choices[0].text


async def _ring_serving(admin: Admin, ring: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, body = await admin.call("GET", f"/rings/{ring}")
        if status == 200 and body["ring"]["phase"] == "serving":
            return body["ring"]
        assert time.monotonic() < deadline, f"ring {ring} not serving after {timeout:g} s: {body}"
        await asyncio.sleep(0.2)


@pytest.mark.slow
def test_the_service_killed_and_restarted_re_forms_its_ring_and_answers(tmp_path, tiny_export, unsplit_greedy):
    export = tiny_export("llama", 2)
    state = tmp_path / "fleet"
    (state / "exports").mkdir(parents=True)
    shutil.copytree(export, state / "exports" / "tiny-2")
    service = ServiceProcess(state, tmp_path / "service.log")

    async def main():
        # no warm spares: they are not what is tested here, and each would compile its stage again
        pcs = [agent(tmp_path, name, warm_spare="off") for name in ("desk-a", "desk-b")]
        admin = None
        t = time.monotonic()

        def lap(what: str) -> None:
            nonlocal t
            print(f"{what}: {time.monotonic() - t:.1f} s", flush=True)
            t = time.monotonic()

        try:
            admin = await service.start()
            lap("service started")
            token = (await admin.ok("POST", "/tokens", {}))["token"]
            enrollment = (await admin.ok("GET", "/service"))["enrollment"]
            nodes = []
            for pc in pcs:
                await pc.async_start()
                await pc.async_join(enrollment, token)
                token = (await admin.ok("POST", "/tokens", {}))["token"]  # single use
                added = (await admin.ok("POST", "/agents", {"host": "127.0.0.1", "port": pc.control_port}))["agent"]
                await admin.ok("POST", f"/agents/{added['key']}/approve")
                nodes.append(added["node_id"])
            plan = {"stages": [{"device_id": f"{nodes[0]}/CPU", "pc_id": nodes[0], "first_layer": 0, "last_layer": 1},
                               {"device_id": f"{nodes[1]}/CPU", "pc_id": nodes[1], "first_layer": 2, "last_layer": 3}]}
            lap("agents joined and approved")
            made = await admin.ok("POST", "/rings", {"plan": plan, "export_id": "tiny-2"})
            assert made["ring"]["ring"] == "r1"
            job = await admin.job(made["job"]["id"], 120)
            assert job["state"] == "done", job
            lap("ring distributed and serving")
            api_url = (await admin.ok("GET", "/service"))["api_url"]
            key = (await admin.ok("POST", "/keys/console/secret"))["secret"]
            before = await _ask(api_url, key, "llama")
            lap("first answer")
            health = await admin.ok("GET", "/health")
            assert health["status"] == "ok" and [r["ring"] for r in health["rings"]] == ["r1"]
            pids = [pc.status().worker.pid for pc in pcs]

            await admin.close()
            admin = None
            await service.kill()  # no goodbye: the rings are re-formed from served-rings.json
            killed = time.monotonic()
            admin = await service.start()
            ring = await _ring_serving(admin, "r1", 90)
            after = await _ask(api_url, key, "llama")
            restart_s = time.monotonic() - killed
            print(f"service restart to first answer: {restart_s:.1f} s")
            assert ring["export_id"] == "tiny-2" and ring["report"]["status"] == "ok"
            assert (await admin.ok("GET", "/service"))["api_url"] == api_url  # the same address for the agents
            return before, after, pids, [pc.status().worker.pid for pc in pcs], restart_s
        finally:
            if admin is not None:
                await admin.close()
            t0 = time.monotonic()
            await service.stop()
            print(f"service stopped in {time.monotonic() - t0:.1f} s", flush=True)
            for pc in pcs:
                t0 = time.monotonic()
                await asyncio.wait_for(pc.async_close(), 60)
                print(f"agent closed in {time.monotonic() - t0:.1f} s", flush=True)

    before, after, pids, pids_after, restart_s = asyncio.run(asyncio.wait_for(main(), 400))
    tokens = unsplit_greedy(PROMPT_IDS, N)
    manifest = load_manifest(export)
    from engine.generation.tokenizer import ChatTokenizer

    eos = set(manifest.model.eos_token_ids)
    expected = list(tokens[:next((i for i, t in enumerate(tokens) if t in eos), N)])
    assert before == after == ChatTokenizer(export / "tokenizer").decode(expected)
    assert pids_after == pids  # the agents' workers kept running: their assignment did not change
    assert restart_s < 30
    assert os.path.exists(Path(service.state) / "served-rings.json")
