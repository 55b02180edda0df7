"""The silent install's join: an agent joins a real fleet service with the token in a root-only
file and removes the file; a failed join keeps it and says why (refused token, a file others may
read, an unreachable console); the headless agent process does it at start from ``--join-file``
and the auto-approving token has the service approve it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from agent.service.join_file import (
    JoinFileError,
    async_join_from_file,
    async_keep_joining,
    consume,
    read_join_file,
)
from tests.fleet_service.conftest import service_in_process
from tests.support.asyncutil import run
from tests.support.console_fleet_helpers import agent

pytestmark = pytest.mark.usefixtures("private_keyring")


def _token_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


async def _until(predicate, timeout: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := predicate()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
    return value


def test_the_file_is_read_strictly_and_said_what_is_wrong(tmp_path):
    from engine.trust.fleet_ca import FleetAuthority
    from engine.trust.join_token import JoinToken

    token = JoinToken.new(FleetAuthority.create("f").fingerprint).text
    assert read_join_file(tmp_path / "none") is None
    assert read_join_file(_token_file(tmp_path / "blank", "\n# used\n")) is None
    got = read_join_file(_token_file(tmp_path / "full", f"# from the installer\n{token}\nconsole=10.0.0.5:7411\n"))
    assert (got.token, got.console) == (token, "10.0.0.5:7411") and token not in repr(got)
    assert read_join_file(_token_file(tmp_path / "kv", f"token={token}\n")).console is None
    for name, text, mode, words in (
            ("typo", token[:-1] + ("A" if token[-1] != "A" else "B"), 0o600, "typo"),
            ("console", f"{token}\nconsole=nowhere\n", 0o600, "host:port"),
            ("garbage", f"{token}\nsomething else\n", 0o600, "does not understand"),
            ("only-console", "console=10.0.0.5:7411\n", 0o600, "no token"),
            ("open", f"{token}\n", 0o644, "chmod 600")):
        path = _token_file(tmp_path / name, text, mode)
        with pytest.raises(JoinFileError, match=words):
            read_join_file(path)
        assert path.read_text() == text  # kept for a person to look at


@pytest.mark.slow
def test_an_agent_joins_with_the_file_which_is_then_gone_and_a_failed_join_keeps_it(tmp_path):
    async def main():
        async with service_in_process(tmp_path / "fleet") as service:
            desk = service.token_desk
            good = desk.issue({"uses": 1, "label": "silent"})["token"]
            revoked = desk.issue({"uses": 5})
            desk.revoke(revoked["token_info"]["id"])
            pc = agent(tmp_path, "rolled-out")
            await pc.async_start()
            try:
                refused = _token_file(tmp_path / "etc" / "refused", f"{revoked['token']}\n"
                                      f"console={service.host.enrollment}\n")
                assert await async_join_from_file(pc, refused) == "refused:revoked"
                assert refused.exists() and not pc.joined
                # nothing listens on the enrolment port of a closed server: unreachable, kept, retried
                dead = _token_file(tmp_path / "etc" / "dead", f"{good}\nconsole=127.0.0.1:9\n")
                assert await async_join_from_file(pc, dead, timeout=3) == "unreachable" and dead.exists()
                keep = asyncio.create_task(async_keep_joining(pc, dead, retry_s=0.2, timeout=3))
                await asyncio.sleep(0.5)
                assert not keep.done()  # still retrying an unreachable console
                _token_file(dead, f"{good}\nconsole={service.host.enrollment}\n")  # the admin fixes the address
                assert await asyncio.wait_for(keep, 30) == "joined"
                assert pc.joined and not dead.exists()
                assert await async_join_from_file(pc, refused) == "already_joined"
                [info] = [t for t in service.host.tokens.tokens() if t.label == "silent"]
                assert [a.node_id for a in info.admitted] == [pc.status().node_id]
            finally:
                await pc.async_close()

    run(main(), 120)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root may remove a file from a read-only folder: nothing to blank")
def test_a_used_file_in_a_folder_the_agent_may_not_write_is_blanked(tmp_path):
    path = _token_file(tmp_path / "etc" / "join-token", "DFJ1-used\n")
    path.parent.chmod(0o500)
    try:
        consume(path)
        assert path.exists() and path.read_text() == ""
    finally:
        path.parent.chmod(0o700)


@pytest.mark.slow
def test_the_headless_agent_joins_at_start_from_its_join_file_and_is_auto_approved(tmp_path):
    env = {**os.environ, "DESKFLEET_KEYRING_DIR": str(tmp_path / "agent-keyring")}

    async def main():
        async with service_in_process(tmp_path / "fleet") as service:
            issued = service.token_desk.issue({"uses": 10, "ttl_s": 3600, "auto_approve": True, "label": "rollout"})
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
                approved = await _until(lambda: [r for r in service.fleet.records() if r.approved], 30,
                                        "the service to approve the agent")
                assert [a.node_id for a in service.host.tokens.tokens()[0].admitted] == [approved[0].node_id]
                audit = [x["event"] for x in service.host.audit.lines() if x["node_id"] == approved[0].node_id]
                assert audit == ["admitted", "auto_approved"]
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 30) == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    run(main(), 180)


def test_the_tray_joins_with_the_installers_token_file_in_its_state_dir(tmp_path, start_tray, qtbot):
    """The Windows installer's path (``/TOKEN=`` writes ``join-token`` in the agent's state dir): the
    tray's bridge joins with it and the file is gone; the same call with nothing to join says so."""
    from agent.service.join_file import default_path
    from tests.support.agent_helpers import console
    from tests.support.asyncutil import held

    with held(lambda: console(tmp_path / "console")) as con:
        tray = start_tray()
        path = _token_file(default_path(tray.bridge.service.state_dir), f"{con.token()}\nconsole={con.enrollment}\n")
        outcomes: list[str] = []
        tray.bridge.join_from_file(path, None, on_result=outcomes.append)
        qtbot.waitUntil(lambda: len(outcomes) == 1, timeout=30_000)
        assert outcomes == ["joined"] and not path.exists() and tray.bridge.service.joined
        tray.bridge.join_from_file(path, None, on_result=outcomes.append)
        qtbot.waitUntil(lambda: len(outcomes) == 2, timeout=10_000)
        assert outcomes[1] == "already_joined"
