"""The headless agent end to end on loopback: join with a token, mutual TLS on every port, assign
-> fetch -> verify -> worker -> a real ring answers, refusals, resumable fetch, pause/resume,
crash restart. Real TLS, real aiohttp, real OpenVINO workers, real zeroconf (bound to 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import replace
from pathlib import Path

import aiohttp
import psutil
import pytest

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from engine.control.client import ControlClient, ControlError
from engine.control.messages import Assignment, WorkerSettings
from engine.errors import DeskfleetError
from engine.generation.request import GenerationRequest
from engine.paged.stage import PagedStage
from engine.shards.manifest import load_manifest
from engine.trust.fleet_ca import FleetAuthority, Role
from engine.trust.peer_policy import PeerPolicy
from engine.wire.address import Address
from tests.conftest import PROMPT_IDS
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import collect, run
from tests.support.loopback import free_port
from tests.support.paged_ring import paged_ring, paged_stage0

N = 12


pytestmark = pytest.mark.usefixtures("private_keyring")


def _settings(**over) -> AgentSettings:
    base = AgentSettings(name="desk-1", interface="127.0.0.1", control_port=0, data_port=0,
                         resume_after_idle_s=1.0, pause_on_battery=True)
    return replace(base, **over)


API_KEY = "sk-deskfleet-agent-test-key"  # rides in the assignment; must never reach a process argument


def _assignment(con, export: Path, export_id: str, *, listen_port: int, next_hop: str) -> Assignment:
    """Stage 1 of a paged ring (the runtime the service assigns a CPU export)."""
    return Assignment.create((export / "manifest.json").read_text(), export_id=export_id, stage=1,
                             source=con.hub.shard_url(export_id), listen_port=listen_port, next_hop=next_hop,
                             worker=WorkerSettings(threads=1, exact=True), runtime="paged",
                             api_url="http://127.0.0.1:8000/v1", events_url=con.hub.events_url,
                             # the console runs stage 0 and the return port: it is both neighbours
                             expect_upstream=(con.credentials.node_id,), expect_next=con.credentials.node_id)


async def _assign(con, client: ControlClient, assignment: Assignment) -> None:
    """Assign as the console does: the hub serves the stage's files to that agent only."""
    await client.async_assign(assignment)
    con.hub.grant(client.peer_node_id, assignment.export_id, [assignment.stage])


async def _ring_tokens(con, export: Path, stage0: PagedStage, agent_data: Address, return_port: int,
                       agent_node: str, *, dial_deadline: float = 30) -> list[int]:
    """N greedy tokens through a paged ring: ``stage0`` here, stage 1 the agent's worker."""
    async with paged_ring(export, stage0, agent_data, Address("127.0.0.1", return_port),
                          server_ssl=con.credentials.server_context(), client_ssl=con.credentials.client_context(),
                          dial_deadline=dial_deadline, peers=PeerPolicy.of([agent_node], agent_node)) as c:
        return await collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))


def test_join_assign_fetch_and_serve_a_stage_in_a_real_ring(tmp_path, tiny_export, unsplit_greedy):
    export = tiny_export("llama", 2)

    async def main():
        async with console(tmp_path, {"tiny-2": export}) as con:
            agent = AgentService(tmp_path / "agent", _settings(), idle_source=FakeIdle(1e6), power=lambda: None)
            await agent.async_start()
            try:
                assert agent.status().state == "not-joined" and agent.control_port is None
                creds = await agent.async_join(con.enrollment, con.token())
                assert creds.node_id == agent.status().node_id and creds.fleet_id == con.authority.fleet_id
                client = ControlClient(con.credentials, "127.0.0.1", agent.control_port)
                status = await client.async_status()
                assert status.state == "idle" and status.node_id == creds.node_id
                assert {d["name"] for d in status.inventory["devices"]} >= {"CPU"}

                data_port, return_port = free_port(), free_port()
                await _assign(con, client, replace(_assignment(con, export, "tiny-2", listen_port=data_port,
                                                              next_hop=f"127.0.0.1:{return_port}"),
                                                  api_key=API_KEY))
                with pytest.raises(ControlError) as early:
                    await client.async_start_worker()
                assert early.value.status == 409  # nothing verified yet: nothing loads
                await client.async_fetch()
                status = await client.async_wait_for(lambda s: s.fetch.finished, 60, "the fetch")
                assert status.fetch.done_bytes == status.fetch.total_bytes > 0
                stored = tmp_path / "agent" / "shards" / "tiny-2"
                assert sorted(p.name for p in (stored / "stage_1").iterdir() if not p.name.startswith(".")) == \
                    sorted(Path(e.path).name for e in load_manifest(export).stages[1].files)
                assert not (stored / "stage_0").exists()  # only this agent's stage travels

                await client.async_start_worker()
                # the ring's stage 0 loads here while the worker loads its stage
                stage0 = asyncio.create_task(asyncio.to_thread(paged_stage0, export, exact=True))
                await agent.async_wait_worker_ready(120)
                # credentials reach the worker over its stdin, never its arguments (any local user reads those)
                cmdline = Path(f"/proc/{agent.worker_pid}/cmdline").read_bytes()
                key_body = b"".join(creds.key_pem.strip().splitlines()[1:-1])  # the PEM's base64, unwrapped
                assert b"--tls-stdin" in cmdline.split(b"\0")
                assert b"--paged" in cmdline.split(b"\0")  # the runtime the assignment names
                for secret in (key_body[:48], API_KEY.encode(), b"PRIVATE KEY", b"sk-deskfleet"):
                    assert secret not in cmdline.replace(b"\0", b"")
                tokens = await _ring_tokens(con, export, await stage0, Address("127.0.0.1", data_port), return_port,
                                            creds.node_id)
                status = await client.async_wait_for(lambda s: s.worker.streams == 0 and s.worker.rss_bytes, 10)
                assert status.state == "serving" and status.worker.state == "running"
                assert status.worker.rss_bytes > 10 << 20

                # An assignment that changes only the peers reaches the running worker as a stdin
                # line (no restart, no recompile); from then on the console is not its upstream.
                pid, stranger = agent.worker_pid, con.authority.issue_credentials("elsewhere", role=Role.AGENT)
                await _assign(con, client, replace(agent.assignment, expect_upstream=(stranger.node_id,)))
                status = await client.async_wait_for(lambda s: s.worker.policy_updates == 1, 30, "the policy line")
                assert agent.worker_pid == pid and status.worker.state == "running" and status.worker.restarts == 0
                with pytest.raises((DeskfleetError, OSError, TimeoutError)):
                    await _ring_tokens(con, export, await stage0, Address("127.0.0.1", data_port), return_port,
                                       creds.node_id, dial_deadline=3)
                return tokens
            finally:
                await agent.async_close()

    assert tuple(run(main())) == unsplit_greedy(PROMPT_IDS, N)


def _bare_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def _raw_status(port: int, ctx: ssl.SSLContext) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async with s.get(f"https://127.0.0.1:{port}/v1/status", ssl=ctx) as r:
            return r.status


def test_control_api_refuses_strangers_and_non_consoles_and_bad_requests(tmp_path, tiny_export, caplog):
    export = tiny_export("llama", 2)

    async def main():
        async with console(tmp_path, {"tiny-2": export}) as con:
            agent = AgentService(tmp_path / "agent", _settings(), idle_source=FakeIdle(1e6), power=lambda: None)
            await agent.async_start()
            try:
                await agent.async_join(con.enrollment, con.token())
                port = agent.control_port
                # no certificate at all: the TLS handshake fails
                with pytest.raises(aiohttp.ClientError):
                    await _raw_status(port, _bare_context())
                # a certificate from another fleet's CA
                other = FleetAuthority.create("other fleet").issue_credentials("intruder", role=Role.CONSOLE)
                with pytest.raises(ControlError):
                    await ControlClient(other, "127.0.0.1", port).async_status()
                # an agent of this fleet may read but not command
                peer = con.authority.issue_credentials("desk-2", role=Role.AGENT)
                peer_client = ControlClient(peer, "127.0.0.1", port)
                assert (await peer_client.async_status()).state == "idle"
                with pytest.raises(ControlError) as forbidden:
                    await peer_client.async_pause()
                assert forbidden.value.status == 403
                # the same refusals on the data port of a running worker, and on the hub
                with pytest.raises(aiohttp.ClientError):
                    async with aiohttp.ClientSession() as s:
                        await s.get(con.hub.shard_url("tiny-2") + "manifest.json", ssl=_bare_context())
                # malformed requests: 4xx, state unchanged
                client = ControlClient(con.credentials, "127.0.0.1", port)
                good = _assignment(con, export, "tiny-2", listen_port=free_port(), next_hop="127.0.0.1:9")
                await _assign(con, client, good)
                before = (tmp_path / "agent" / "state.json").read_text()
                for body in ({}, {**good.to_dict(), "stage": 9}, {**good.to_dict(), "manifest_sha256": "0" * 64}):
                    with pytest.raises(ControlError) as bad:
                        await client._call("POST", "/v1/assign", body)
                    assert bad.value.status == 400
                with pytest.raises(ControlError) as bad_cap:
                    await client._call("POST", "/v1/fetch", {"bandwidth_cap_bytes_s": -1})
                assert bad_cap.value.status == 400
                assert (tmp_path / "agent" / "state.json").read_text() == before
                assert (await client.async_status()).export_id == "tiny-2"
            finally:
                await agent.async_close()

    run(main())
    assert "refused" in caplog.text


@pytest.mark.slow
def test_corrupt_shards_are_refused_and_interrupted_fetches_resume(tmp_path, tiny_export):
    import shutil

    good = tiny_export("llama", 2)
    bad = tmp_path / "bad-export"
    shutil.copytree(good, bad)
    big = max((p for p in (bad / "stage_1").iterdir()), key=lambda p: p.stat().st_size)
    blob = bytearray(big.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    big.write_bytes(bytes(blob))  # same size, wrong sha256: only the hash can tell

    async def main():
        async with console(tmp_path, {"good": good, "bad": bad}) as con:
            agent = AgentService(tmp_path / "agent", _settings(), idle_source=FakeIdle(1e6), power=lambda: None)
            await agent.async_start()
            try:
                await agent.async_join(con.enrollment, con.token())
                client = ControlClient(con.credentials, "127.0.0.1", agent.control_port)
                await _assign(con, client,
                              _assignment(con, bad, "bad", listen_port=free_port(), next_hop="127.0.0.1:9"))
                await client.async_fetch()
                status = await client.async_wait_for(lambda s: s.state == "error", 60, "the corrupt fetch to fail")
                assert "sha256" in status.worker.last_error
                assert not (tmp_path / "agent" / "shards" / "bad" / "stage_1" / big.name).exists()
                with pytest.raises(ControlError) as refused:
                    await client.async_start_worker()
                assert refused.value.status == 409

                # a slow download interrupted half-way resumes from where it stopped
                total = sum(e.size for e in load_manifest(good).stages[1].files)
                await _assign(con, client,
                              _assignment(con, good, "good", listen_port=free_port(), next_hop="127.0.0.1:9"))
                served_before = con.hub.bytes_served
                await client.async_fetch(bandwidth_cap_bytes_s=max(total // 2, 1))
                await client.async_wait_for(lambda s: s.fetch.done_bytes > total // 4, 30, "part of the fetch")
                agent._fetch_task.cancel()  # the network drops / the agent restarts
                await asyncio.sleep(0.2)
                first_leg = con.hub.bytes_served - served_before
                assert first_leg < total
                await client.async_fetch()
                await client.async_wait_for(lambda s: s.fetch.finished, 60, "the resumed fetch")
                assert con.hub.bytes_served - served_before <= total + (256 << 10)  # no file sent twice
                # a verified file that is later truncated on disk is no longer served from
                stored = tmp_path / "agent" / "shards" / "good" / "stage_1" / big.name
                os.truncate(stored, stored.stat().st_size // 2)
                with pytest.raises(ControlError) as truncated:
                    await client.async_start_worker()
                assert truncated.value.status == 409
                await client.async_fetch()  # only the damaged file travels again
                await client.async_wait_for(lambda s: s.fetch.finished, 60, "the repair fetch")
            finally:
                await agent.async_close()

    run(main())


@pytest.mark.slow
def test_idle_input_pauses_resumes_after_and_crashes_restart(tmp_path, tiny_export):
    export = tiny_export("llama", 2)
    idle = FakeIdle(1e6)

    async def main():
        async with console(tmp_path, {"tiny-2": export}) as con:
            agent = AgentService(tmp_path / "agent", _settings(), idle_source=idle, power=lambda: None)
            await agent.async_start()
            try:
                await agent.async_join(con.enrollment, con.token())
                client = ControlClient(con.credentials, "127.0.0.1", agent.control_port)
                await _assign(con, client, _assignment(con, export, "tiny-2", listen_port=free_port(),
                                                      next_hop="127.0.0.1:9"))
                await client.async_fetch()
                await client.async_wait_for(lambda s: s.fetch.finished, 60)
                await client.async_start_worker()
                await agent.async_wait_worker_ready(120)
                pid = agent.worker_pid
                proc = psutil.Process(pid)

                idle.seconds = 0.0  # someone touches the keyboard
                # the worker is gone: its cores are free again (how fast: the agent benchmark's pause rows;
                # the limit here is a hang guard)
                await asyncio.to_thread(proc.wait, 30.0)
                status = await client.async_status()
                assert status.state == "paused" and "the PC is in use" in status.paused_reasons
                await asyncio.sleep(0.3)
                assert [e.event for e in con.hub.events][-1:] == ["paused"]

                idle.seconds = 5.0  # idle longer than resume_after_idle_s (1 s)
                await agent.async_wait_worker_ready(60)
                status = await client.async_wait_for(lambda s: s.state == "serving", 10)
                assert agent.worker_pid != pid

                # the console pauses and resumes it remotely
                await client.async_pause()
                assert (await client.async_status()).paused_reasons == ("paused from the console",)
                await client.async_resume()
                await agent.async_wait_worker_ready(60)

                # a crashed worker is restarted
                crashed = agent.worker_pid
                psutil.Process(crashed).kill()
                status = await client.async_wait_for(lambda s: s.worker.restarts >= 1 and s.worker.state == "running",
                                                     30, "the worker to be restarted")
                assert agent.worker_pid not in (None, crashed)
            finally:
                await agent.async_close()

    run(main())
