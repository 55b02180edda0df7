"""Join tokens through the fleet service's admin API, with a real service and real agents on
loopback: a reusable auto-approving token admits and approves PCs as they register (the audit
names the token and each PC), a plain token admits without approving, a revoked token admits
nobody, and what the service refuses to issue or revoke is a clear 400 / 404; the CLI over it.
And the silent install's join: an agent joins with the token in a root-only file and the file is
gone; a failed join keeps it and says why (a revoked token, an unreachable console, retried
until the address is fixed); the headless agent process joins at start from ``--join-file``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from agent.service.join_file import async_join_from_file, async_keep_joining
from console.fleet_api.admin_client import AdminClient
from engine.errors import JoinRefused
from tests.fleet_service.admin import Admin
from tests.support.console_fleet_helpers import agent

pytestmark = pytest.mark.usefixtures("private_keyring")


async def _agents_until(admin: Admin, predicate, timeout: float = 30.0) -> list[dict]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        agents = (await admin.ok("GET", "/agents"))["agents"]
        if predicate(agents):
            return agents
        assert loop.time() < deadline, f"the agents never got there: {agents}"
        await asyncio.sleep(0.2)


@pytest.mark.slow
def test_an_auto_approving_token_approves_the_pcs_it_admits_and_the_audit_names_it(tmp_path, shared_service):
    async def main():
        service = shared_service.service
        seeds = (f"127.0.0.1:{service.host.hub.port}",)  # agents register at the hub: verified there
        async with Admin.unix(service.settings.state_dir / "admin.sock") as admin:
            auto = await admin.ok("POST", "/tokens", {"uses": 2, "ttl_s": 3600, "auto_approve": True,
                                                      "label": "floor 3 roll-out"})
            plain = await admin.ok("POST", "/tokens", {"label": "by hand"})
            assert auto["token_info"]["uses"] == 2 and auto["token_info"]["auto_approve"]
            assert plain["token_info"]["uses"] == 1 and not plain["token_info"]["auto_approve"]
            pcs = [agent(tmp_path, name, seeds=seeds) for name in ("floor3-a", "floor3-b", "desk-c")]
            await asyncio.gather(*(pc.async_start() for pc in pcs))
            try:
                await asyncio.gather(*(pc.async_join(service.host.enrollment, token) for pc, token in
                                       zip(pcs, (auto["token"], auto["token"], plain["token"]), strict=True)))
                agents = await _agents_until(admin, lambda a: len(a) == 3 and sum(x["approved"] for x in a) == 2)
                by_pc = {pc.settings.name: next(a for a in agents if a["node_id"] == pc.status().node_id) for pc in pcs}
                assert by_pc["floor3-a"]["approved"] and by_pc["floor3-b"]["approved"]
                assert not by_pc["desk-c"]["approved"]  # a plain token admits; the admin approves

                listing = {t["id"]: t for t in (await admin.ok("GET", "/tokens"))["tokens"]}
                used = listing[auto["token_info"]["id"]]
                assert (used["used"], used["uses_left"], used["state"]) == (2, 0, "used_up")
                assert {a["node_id"] for a in used["admitted"]} == {pcs[0].status().node_id, pcs[1].status().node_id}
                assert [a["name"] for a in listing[plain["token_info"]["id"]]["admitted"]] == ["desk-c"]

                lines = (await admin.ok("GET", "/tokens/audit"))["lines"]
                auto_lines = [(x["name"], x["token_id"], x["token_label"]) for x in lines
                              if x["event"] == "auto_approved"]
                assert sorted(auto_lines) == [("floor3-a", auto["token_info"]["id"], "floor 3 roll-out"),
                                              ("floor3-b", auto["token_info"]["id"], "floor 3 roll-out")]
                admitted = {x["name"]: x["token_id"] for x in lines if x["event"] == "admitted"}
                assert admitted["desk-c"] == plain["token_info"]["id"]

                await admin.ok("POST", f"/agents/{by_pc['desk-c']['key']}/approve")
                lines = (await admin.ok("GET", "/tokens/audit"))["lines"]
                assert [(x["name"], x["token_id"]) for x in lines if x["event"] == "approved"] == \
                    [("desk-c", plain["token_info"]["id"])]
                for a in agents:  # leave the shared service's fleet empty for the next test
                    await admin.ok("DELETE", f"/agents/{a['key']}")
            finally:
                for pc in pcs:
                    await pc.async_close()

    shared_service.run(main(), 180)


def test_a_revoked_token_admits_nobody_and_bad_requests_are_named(tmp_path, shared_service):
    async def main():
        service = shared_service.service
        client = AdminClient.over_socket(service.settings.state_dir / "admin.sock")
        try:
            issued = await client.async_issue_token(uses=5, ttl_s=None, label="no expiry")
            assert issued["expires_at"] is None and issued["token_info"]["state"] == "active"
            revoked = await client.async_revoke_token(issued["token_info"]["id"])
            assert revoked["state"] == "revoked" and revoked["uses_left"] == 0
            listed = {t["id"]: t for t in await client.async_tokens()}
            assert listed[issued["token_info"]["id"]]["state"] == "revoked"
            pc = agent(tmp_path, "late-pc")
            await pc.async_start()
            try:
                with pytest.raises(JoinRefused) as refused:
                    await pc.async_join(service.host.enrollment, issued["token"])
                assert refused.value.reason == "revoked" and not pc.joined
            finally:
                await pc.async_close()
        finally:
            await client.async_close()
        async with Admin.unix(service.settings.state_dir / "admin.sock") as admin:
            status, err = await admin.call("POST", "/tokens", {"auto_approve": True, "ttl_s": None})
            assert status == 400 and "must expire" in err["error"]["message"]
            for body, word in (({"uses": 0}, "1 to"), ({"uses": "many"}, "integer"), ({"ttl_s": -5}, "positive"),
                               ({"label": "x" * 200}, "label")):
                status, err = await admin.call("POST", "/tokens", body)
                assert status == 400 and word in err["error"]["message"], (body, err)
            status, err = await admin.call("POST", "/tokens/0123456789/revoke")
            assert status == 404 and "no join token" in err["error"]["message"]

    shared_service.run(main(), 120)


def test_the_fleet_cli_issues_lists_and_revokes_tokens(tmp_path, shared_service, capsys):
    import argparse

    from console.fleet.cli import configure, run
    from engine.errors import DeskfleetError

    state = shared_service.service.settings.state_dir

    def cli(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        configure(parser)
        assert run(parser.parse_args(["tokens", *argv, "--state-dir", str(state)])) == 0
        return capsys.readouterr().out

    issued = cli("issue", "--uses", "3", "--ttl", "7200", "--label", "cli roll-out", "--auto-approve")
    token_id = issued.split()[1].rstrip(":")
    assert "3 use(s)" in issued and "auto-approving" in issued and "DFJ1-" in issued
    listing = cli("list")
    assert "cli roll-out" in listing and token_id in listing and listing.splitlines()[0].startswith("Label")
    path = tmp_path / "deploy" / "join-token"
    assert "written to" in cli("issue", "--token-file", str(path))
    assert path.read_text().startswith("DFJ1-") and (path.stat().st_mode & 0o077) == 0
    assert f"token {token_id} is revoked" in cli("revoke", token_id)
    for argv, words in ((("revoke",), "say which token"), (("issue", "--ttl", "soon"), "--ttl"),
                        (("issue", "--ttl", "never", "--auto-approve"), "must expire"),
                        (("frobnicate",), "list|issue")):
        parser = argparse.ArgumentParser()
        configure(parser)
        with pytest.raises(DeskfleetError, match=words):
            run(parser.parse_args(["tokens", *argv, "--state-dir", str(state)]))


def test_pcs_pending_auto_approval_survive_a_restart_and_a_revoked_token_approves_nobody(tmp_path):
    """TokenDesk's policy over a real token book and audit file, with the approval recorded by a
    list (no service): what a restarted service does with PCs admitted but not yet registered."""
    from console.fleet.join_tokens import TokenDesk
    from console.fleet_api.agent_record import AgentRecord, AgentSource, Membership
    from engine.control.join_audit import JoinAudit
    from engine.trust.fleet_ca import FleetAuthority
    from engine.trust.join_token import TokenBook

    authority = FleetAuthority.create("desk")
    book = TokenBook(tmp_path / "tokens.json", authority.fingerprint)
    audit = JoinAudit(tmp_path / "audit.jsonl")
    kept, revoked = book.issue_token(uses=2, auto_approve=True), book.issue_token(uses=2, auto_approve=True)
    for issued, node in ((kept, "a" * 64), (revoked, "b" * 64)):
        book.record_admission(book.redeem(issued.text).token_id, node, f"pc-{node[0]}")
    book.revoke(revoked.info.token_id)

    def record(node: str, approved: bool = False) -> AgentRecord:
        return AgentRecord(node, "", "127.0.0.1", 7210, "idle", (), 0, authority.fleet_id, Membership.MEMBER, 1.0,
                           frozenset({AgentSource.HUB}), approved, verified=True)

    approved: list[str] = []
    events: list[str] = []
    desk = TokenDesk(book, audit, lambda kind, data: events.append(kind))
    desk.attach(lambda node: approved.append(node) or record(node, True), ())  # as after a restart
    desk.on_records((record("a" * 64), record("b" * 64)))
    assert approved == ["a" * 64]  # the revoked token's PC waits for the admin
    assert [(x["event"], x["name"], x["token_id"]) for x in audit.lines()] == \
        [("auto_approved", "pc-a", kept.info.token_id)]
    desk.on_records((record("a" * 64, True), record("b" * 64)))
    assert approved == ["a" * 64]  # once is enough


# -- the silent install's token file, joined against this service ------------------------------------

def _token_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)
    return path


async def _until_true(predicate, timeout: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := predicate()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
    return value


def test_an_agent_joins_with_the_file_which_is_then_gone_and_a_failed_join_keeps_it(tmp_path, shared_service):
    async def main():
        service = shared_service.service
        desk, label = service.token_desk, f"silent-{uuid.uuid4().hex[:6]}"
        good = desk.issue({"uses": 1, "label": label})["token"]
        revoked = desk.issue({"uses": 5})
        desk.revoke(revoked["token_info"]["id"])
        pc = agent(tmp_path, "rolled-out")
        await pc.async_start()
        try:
            refused = _token_file(tmp_path / "etc" / "refused", f"{revoked['token']}\n"
                                  f"console={service.host.enrollment}\n")
            assert await async_join_from_file(pc, refused) == "refused:revoked"
            assert refused.exists() and not pc.joined
            # nothing listens on the discard port: unreachable, the file kept, tried again
            dead = _token_file(tmp_path / "etc" / "dead", f"{good}\nconsole=127.0.0.1:9\n")
            assert await async_join_from_file(pc, dead, timeout=3) == "unreachable" and dead.exists()
            keep = asyncio.create_task(async_keep_joining(pc, dead, retry_s=0.2, timeout=3))
            await asyncio.sleep(0.5)
            assert not keep.done()  # still retrying an unreachable console
            _token_file(dead, f"{good}\nconsole={service.host.enrollment}\n")  # the admin fixes the address
            assert await asyncio.wait_for(keep, 30) == "joined"
            assert pc.joined and not dead.exists()
            assert await async_join_from_file(pc, refused) == "already_joined"
            [info] = [t for t in service.host.tokens.tokens() if t.label == label]
            assert [a.node_id for a in info.admitted] == [pc.status().node_id]
        finally:
            await pc.async_close()

    shared_service.run(main(), 120)


@pytest.mark.slow
def test_the_headless_agent_joins_at_start_from_its_join_file_and_is_auto_approved(tmp_path, shared_service):
    env = {**os.environ, "DESKFLEET_KEYRING_DIR": str(tmp_path / "agent-keyring")}

    async def main():
        service, label = shared_service.service, f"rollout-{uuid.uuid4().hex[:6]}"
        issued = service.token_desk.issue({"uses": 10, "ttl_s": 3600, "auto_approve": True, "label": label})
        path = _token_file(tmp_path / "etc" / "deskfleet" / "join-token",
                           f"{issued['token']}\nconsole={service.host.enrollment}\n")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine.cli.main", "agent", "--headless", "--state-dir", str(tmp_path / "a"),
            "--interface", "127.0.0.1", "--control-port", "0", "--data-port", "0",
            "--seed", f"127.0.0.1:{service.host.hub.port}", "--join-file", str(path),
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        lines: list[str] = []
        try:
            while not any(line.startswith("deskfleet agent: idle") for line in lines):
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                assert line, "the agent exited: " + "".join(lines)
                lines.append(line.decode())
            assert any("joined fleet" in line and str(path) in line for line in lines), lines
            assert not path.exists()
            [info] = [t for t in service.host.tokens.tokens() if t.label == label]
            [node] = [a.node_id for a in info.admitted]
            await _until_true(lambda: any(r.node_id == node and r.approved for r in service.fleet.records()), 30,
                         "the service to approve the agent")
            audit = [x["event"] for x in service.host.audit.lines() if x["node_id"] == node]
            assert audit == ["admitted", "auto_approved"]
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            service.remove(node)  # leave the shared service's fleet as it was
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    shared_service.run(main(), 180)
