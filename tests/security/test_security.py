"""Security refusals on the real ports, each refused and logged (issue 7).

Already covered elsewhere, not repeated here:
- tests/trust/test_trust.py: mutual TLS on a bare aiohttp server (no certificate, another fleet's,
  expired, a client trusting another CA); the token book refusing replayed, expired, unknown,
  malformed and foreign tokens.
- tests/control/test_enrollment.py: used/expired/unknown tokens answered 403 with the reason and logged;
  malformed join requests; a console that cannot prove the pinned CA.
- tests/agent/test_agent_service.py: the control API and hub refuse a client without a certificate;
  a fleet member without the console role gets 403; a corrupt shard fails the fetch (state error)
  and a damaged verified file blocks the worker start (409).
- tests/agent/test_agent_policy.py, test_manifest.py, test_export_errors.py: the pure checks (escaping
  manifest paths, sha256/size mismatches). tests/wire/test_transport_live.py: the frame server with a
  throwaway PKI. tests/control/test_fuzz_console.py: hub traversal spellings and ranges, fuzzed.

Here, on the running control API (agent), hub (console), stage worker data port
(a paged ``PagedStageWorker`` with ``Credentials.server_context()``; ``deskfleet worker --paged``'s
own code for a shard that fails its checks) and enrollment (console): strangers with
no certificate, another fleet's certificate or an expired one; replayed and expired join tokens
through a real agent; a manifest path escaping the shard store; a shard whose hash does not match.
Each must be refused and leave a log record. Enrollment takes no client certificate by design
(the join token is the proof), so the certificate cases apply to the three mutual-TLS ports and
the token cases to enrollment; manifests and shards never reach enrollment.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import shutil
import ssl
import tempfile
from pathlib import Path

import aiohttp
import pytest

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from engine.control.client import ControlClient, ControlError
from engine.control.messages import Assignment, WorkerSettings
from engine.errors import JoinRefused, ManifestError
from engine.paged.stage import PagedStage
from engine.paged.worker import PagedStageWorker
from engine.shards.manifest import load_manifest
from engine.trust.fleet_ca import Credentials, FleetAuthority, Role, make_key_and_csr
from engine.trust.peer_policy import PeerPolicy
from engine.wire.address import Address
from engine.wire.format import Role as WireRole
from engine.wire.messages import Hello
from engine.wire.transport import async_connect
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import run
from tests.support.loopback import free_port

pytestmark = pytest.mark.usefixtures("private_keyring")


def _agent(root: Path, name: str = "desk-1") -> AgentService:
    settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0)
    return AgentService(root / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)


async def _logged(caplog, since: int, logger: str, *words: str, timeout: float = 5.0) -> str:
    """The first record of ``logger`` after record ``since`` holding every word (the refusing
    side may log a moment after the client saw the refusal)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        for r in caplog.records[since:]:
            if r.name == logger and all(w in r.getMessage() for w in words):
                return r.getMessage()
        assert asyncio.get_running_loop().time() < deadline, \
            f"no {logger} record with {words}: {[r.getMessage() for r in caplog.records[since:]][-5:]}"
        await asyncio.sleep(0.05)


# -- strangers on the mutual-TLS ports ---------------------------------------------------------------

def _anonymous(ca_pem: bytes) -> ssl.SSLContext:
    """A client that trusts the fleet CA (so it gets as far as it can) and presents no certificate."""
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    ctx.check_hostname = False
    return ctx


def _presenting(ca_pem: bytes, creds: Credentials) -> ssl.SSLContext:
    """A client that trusts the fleet CA and presents ``creds``' certificate."""
    ctx = _anonymous(ca_pem)
    with tempfile.TemporaryDirectory() as tmp:
        chain = os.path.join(tmp, "chain.pem")
        Path(chain).write_bytes(creds.cert_pem + creds.key_pem)
        ctx.load_cert_chain(chain)
    return ctx


def _expired(authority: FleetAuthority) -> Credentials:
    key, csr = make_key_and_csr("old-desk")
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=400)
    return Credentials(authority.ca_pem, authority.sign_request(csr, role=Role.AGENT, days=30, now=long_ago), key)


async def _knock(kind: str, port: int, ctx: ssl.SSLContext, fingerprint: str) -> str | None:
    """None if the port let this client in, else how it was turned away."""
    try:
        if kind == "frames":
            conn = await async_connect("127.0.0.1", port, Hello(fingerprint, 1, WireRole.STAGE), ssl=ctx, attempts=1)
            await conn.async_close()
        else:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
                    s.get(f"https://127.0.0.1:{port}/v1/status", ssl=ctx) as r:
                await r.read()
    except Exception as exc:  # the TLS handshake (or the first read after it) failed
        return type(exc).__name__
    return None


def test_strangers_are_refused_and_logged_on_every_mutual_tls_port(tmp_path, tiny_export, caplog):
    caplog.set_level(logging.DEBUG, logger="engine.trust.fleet_ca")
    export = tiny_export("llama", 2)
    other = FleetAuthority.create("another fleet").issue_credentials("intruder", role=Role.CONSOLE)

    async def main():
        async with console(tmp_path / "console", {"tiny-2": export}) as con:
            agent = _agent(tmp_path)
            await agent.async_start()
            worker_creds = con.authority.issue_credentials("desk-2", role=Role.AGENT)
            worker = PagedStageWorker(PagedStage(export, 1, exact=True), Address("127.0.0.1", 0),
                                      Address("127.0.0.1", 9), kv_pool_bytes=16 << 20,
                                      server_ssl=worker_creds.server_context(),
                                      client_ssl=worker_creds.client_context(),
                                      peers=PeerPolicy.of([worker_creds.node_id]))  # the member that knocks below
            try:
                await agent.async_join(con.enrollment, con.token())
                data = await worker.async_start()
                ca = con.authority.ca_pem
                strangers = {"no certificate": (_anonymous(ca), "presented no certificate"),
                             "another fleet's certificate": (_presenting(ca, other), "not a valid one"),
                             "an expired certificate": (_expired(con.authority).client_context(), "not a valid one")}
                ports = {"control API": ("https", agent.control_port), "hub": ("https", con.hub.port),
                         "worker data port": ("frames", data.port)}
                fingerprint = load_manifest(export).model.fingerprint
                outcomes = {}
                for port_name, (kind, port) in ports.items():
                    for who, (ctx, meaning) in strangers.items():
                        since = len(caplog.records)
                        turned_away = await _knock(kind, port, ctx, fingerprint)
                        logged = await _logged(caplog, since, "engine.trust.fleet_ca", "refused a TLS connection",
                                               meaning)
                        outcomes[(port_name, who)] = (turned_away, logged)
                member = worker_creds.client_context()
                let_in = {name: await _knock(kind, port, member, fingerprint) for name, (kind, port) in ports.items()}
                return outcomes, let_in
            finally:
                await worker.async_close()
                await agent.async_close()

    outcomes, let_in = run(main(), 120)
    assert len(outcomes) == 9
    for (port_name, who), (turned_away, logged) in outcomes.items():
        assert turned_away, f"{port_name} let in a client with {who}"
        assert "only members of this fleet may connect" in logged
    # the hub answers a member's /v1/status with 404, which is being let in; the others answer it
    assert let_in == {"control API": None, "hub": None, "worker data port": None}


# -- join tokens at the enrollment port, through a real agent ------------------------------------------

@pytest.mark.slow
def test_replayed_and_expired_join_tokens_leave_the_agent_outside_and_are_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="deskfleet.enrollment")

    async def main():
        async with console(tmp_path / "console") as con:
            first, second = _agent(tmp_path, "desk-1"), _agent(tmp_path, "desk-2")
            await first.async_start()
            await second.async_start()
            try:
                token = con.token()
                await first.async_join(con.enrollment, token)
                refusals = {}
                for case in ("used", "expired"):
                    if case == "expired":
                        token = con.token(ttl_s=0.2)
                        await asyncio.sleep(0.5)
                    since = len(caplog.records)
                    with pytest.raises(JoinRefused) as refused:
                        await second.async_join(con.enrollment, token)
                    logged = await _logged(caplog, since, "deskfleet.enrollment", "join refused", case)
                    refusals[case] = (refused.value.reason, logged, second.joined, second.control_port,
                                      second.keystore.load())
                return refusals, first.joined
            finally:
                await second.async_close()
                await first.async_close()

    refusals, first_joined = run(main(), 120)
    assert first_joined
    for case, (reason, logged, joined, port, stored) in refusals.items():
        assert reason == case and "desk-2" in logged
        assert not joined and port is None and stored is None, f"a {case} token left the agent half inside"


# -- a worker that must refuse its shard ------------------------------------------------------------

async def _refused_worker(caplog, export: Path, port: int, *words: str) -> str:
    """``deskfleet worker --paged`` for stage 1 of ``export`` on ``port`` (the command line's own
    code, in this process): it must exit with an error without listening, and log why; that record."""
    from engine.cli.main import main as deskfleet

    since = len(caplog.records)
    argv = ["worker", "--shard", str(export), "--stage", "1", "--paged", "--listen", f"127.0.0.1:{port}",
            "--next", "127.0.0.1:9"]
    assert await asyncio.to_thread(deskfleet, argv) == 1
    logged = [r.getMessage() for r in caplog.records[since:] if r.levelno >= logging.ERROR]
    found = [m for m in logged if all(w in m for w in ("refusing to serve stage 1", *words))]
    assert found, f"no error record saying it refused the shard: {logged}"
    return found[0]


# -- a manifest path escaping the shard store ---------------------------------------------------------

def _escaping_copy(export: Path, dest: Path) -> Path:
    shutil.copytree(export, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    files = manifest["stages"][1]["files"]  # one more file, outside: the stage's own IR stays listed
    files.append({**files[0], "path": "../../outside.bin"})
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (dest.parent / "outside.bin").write_bytes(b"not a shard")
    return dest


def _assignment(con, manifest_json: str, export_id: str) -> Assignment:
    return Assignment.create(manifest_json, export_id=export_id, stage=1, source=con.hub.shard_url(export_id),
                             listen_port=free_port(), next_hop="127.0.0.1:9", worker=WorkerSettings(threads=1))


@pytest.mark.slow
def test_a_manifest_path_escaping_the_shard_store_is_refused_and_logged_on_every_port(tmp_path, tiny_export,
                                                                                     caplog):
    caplog.set_level(logging.INFO)
    evil = _escaping_copy(tiny_export("llama", 2), tmp_path / "exports" / "evil")

    async def main():
        async with console(tmp_path / "console", {}) as con:
            since = len(caplog.records)
            with pytest.raises(ManifestError, match="unsafe|escapes"):  # the hub will not publish it
                con.hub.publish("evil", evil)
            hub_log = await _logged(caplog, since, "engine.control.hub", "refusing to publish evil")
            member = con.authority.issue_credentials("desk-9", role=Role.AGENT).client_context()
            async with aiohttp.ClientSession() as s, \
                    s.get(f"https://127.0.0.1:{con.hub.port}/v1/shards/evil/..%2F..%2Foutside.bin", ssl=member) as r:
                hub_status = r.status
            await _logged(caplog, since, "engine.control.hub", "refused shard request")

            agent = _agent(tmp_path)
            await agent.async_start()
            try:
                await agent.async_join(con.enrollment, con.token())
                client = ControlClient(con.credentials, "127.0.0.1", agent.control_port)
                since = len(caplog.records)
                with pytest.raises(ControlError) as refused:
                    await client.async_assign(_assignment(con, (evil / "manifest.json").read_text(), "evil"))
                control_log = await _logged(caplog, since, "agent.service.control_api", "/v1/assign refused")
                assigned = (await client.async_status()).export_id
            finally:
                await agent.async_close()

        port = free_port()
        worker_log = await _refused_worker(caplog, evil, port)
        with pytest.raises(OSError):  # nothing ever listened
            await asyncio.open_connection("127.0.0.1", port)
        return hub_log, hub_status, refused.value.status, control_log, assigned, worker_log

    hub_log, hub_status, control_status, control_log, assigned, worker_log = run(main(), 120)
    assert "outside.bin" in hub_log and hub_status == 404
    assert control_status == 400 and "outside.bin" in control_log and assigned is None
    assert "outside.bin" in worker_log and ("unsafe" in worker_log or "escapes" in worker_log)


# -- a shard whose hash does not match ----------------------------------------------------------------

@pytest.mark.slow
def test_a_shard_whose_hash_does_not_match_is_refused_and_logged_on_every_port(tmp_path, tiny_export, caplog):
    caplog.set_level(logging.INFO)
    bad = tmp_path / "exports" / "bad"
    shutil.copytree(tiny_export("llama", 2), bad)
    big = max((bad / "stage_1").iterdir(), key=lambda p: p.stat().st_size)
    blob = bytearray(big.read_bytes())
    blob[len(blob) // 3] ^= 0x55
    big.write_bytes(bytes(blob))  # same size: only the sha256 tells

    async def main():
        port = free_port()
        worker_log = await _refused_worker(caplog, bad, port, big.name)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

        async with console(tmp_path / "console", {"bad": bad}) as con:  # the hub serves it as the manifest says
            agent = _agent(tmp_path)
            await agent.async_start()
            try:
                await agent.async_join(con.enrollment, con.token())
                client = ControlClient(con.credentials, "127.0.0.1", agent.control_port)
                await client.async_assign(_assignment(con, (bad / "manifest.json").read_text(), "bad"))
                con.hub.grant(client.peer_node_id, "bad", [1])  # as the console does with an assignment
                since = len(caplog.records)
                await client.async_fetch()
                status = await client.async_wait_for(lambda s: s.state == "error", 60, "the fetch to fail")
                fetch_log = await _logged(caplog, since, "agent.service.service", "shard fetch failed", big.name)
                with pytest.raises(ControlError) as refused:
                    await client.async_start_worker()
                start_log = await _logged(caplog, since, "agent.service.control_api", "/v1/worker/start refused")
                kept = (tmp_path / "desk-1" / "shards" / "bad" / "stage_1" / big.name).exists()
                return worker_log, fetch_log, status.worker.last_error, refused.value.status, start_log, kept
            finally:
                await agent.async_close()

    worker_log, fetch_log, last_error, start_status, start_log, kept = run(main(), 180)
    assert "sha256" in worker_log and "sha256" in fetch_log and "sha256" in last_error
    assert start_status == 409 and not kept
    assert start_log
