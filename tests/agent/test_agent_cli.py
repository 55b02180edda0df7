"""`deskfleet agent --headless` as a real process: it joins with a token, is found by a zeroconf
browser on loopback with its TXT fields, registers with its seed console by address, answers the
unicast probe, and withdraws its advertisement on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import signal
import sys
from pathlib import Path

import pytest

from agent.cli import configure, read_join_token
from engine.control.client import ControlClient
from engine.discovery.mdns import Browser
from engine.errors import DeskfleetError
from tests.support.agent_helpers import console
from tests.support.asyncutil import run


async def _until(predicate, timeout: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := predicate()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)
    return value


def test_headless_agent_joins_is_discovered_registers_and_withdraws(tmp_path):
    env = {**os.environ, "DESKFLEET_KEYRING_DIR": str(tmp_path / "keyring")}

    async def main():
        async with console(tmp_path) as con:
            browser = Browser("127.0.0.1")
            await browser.async_start()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "engine.cli.main", "agent", "--headless", "--state-dir", str(tmp_path / "a"),
                "--interface", "127.0.0.1", "--control-port", "0", "--data-port", "0",
                "--seed", f"127.0.0.1:{con.hub.port}", "--join", "-", "--console", con.enrollment,
                env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT)
            token = con.token()
            proc.stdin.write(token.encode() + b"\n")
            proc.stdin.close()
            try:
                def joined_peer():
                    return next((p.advertisement for p in browser.peers().values()  # ours, not another test's
                                 if p.advertisement.state == "idle"
                                 and p.advertisement.fleet_id == con.authority.fleet_id),
                                None)

                ad = await _until(joined_peer, 60, "the joined agent's advertisement")
                if sys.platform == "linux":  # what every local user can read
                    assert token not in Path(f"/proc/{proc.pid}/cmdline").read_text(errors="replace")
                assert ad.fleet_id == con.authority.fleet_id
                assert "CPU" in ad.devices and ad.memory_bytes > 1 << 30
                assert ad.addresses == ("127.0.0.1",) and ad.control_port > 0
                probe = await ControlClient(con.credentials, "127.0.0.1", ad.control_port).async_probe()
                assert probe["node_id"] == ad.node_id  # the advertised node id is the certificate's fingerprint
                await _until(lambda: ad.node_id in con.hub.registrations, 30, "registration with the seed")
                assert con.hub.registrations[ad.node_id]["control_port"] == ad.control_port
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 30) == 0
                await _until(lambda: all(p.advertisement.node_id != ad.node_id for p in browser.peers().values()), 10,
                             "the advertisement to be withdrawn")
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                await browser.async_close()
            return (await proc.stdout.read()).decode()

    output = run(main())
    assert "joined fleet" in output


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_the_join_token_comes_from_a_file_or_standard_input_never_the_command_line(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("dfj1.secret-token\n")
    assert read_join_token(_args("--join-file", str(token_file)), io.StringIO()) == "dfj1.secret-token"
    assert read_join_token(_args("--join", "-"), io.StringIO(" dfj1.from-stdin \nrest")) == "dfj1.from-stdin"
    assert read_join_token(_args(), io.StringIO("ignored")) is None
    with pytest.raises(DeskfleetError, match="--join -.*--join-file"):
        read_join_token(_args("--join", "dfj1.on-the-command-line"), io.StringIO())
    with pytest.raises(DeskfleetError, match="no join token in standard input"):
        read_join_token(_args("--join", "-"), io.StringIO("\n"))
    with pytest.raises(DeskfleetError, match="cannot read the join token file"):
        read_join_token(_args("--join-file", str(tmp_path / "missing")), io.StringIO())
    with pytest.raises(SystemExit):  # one source only
        _args("--join", "-", "--join-file", str(token_file))
