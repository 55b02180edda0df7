"""The console's enrollment address over mDNS: the record's checks (pure) and, on loopback only,
a real console half advertising it, found by pin, and joined by an agent given only the token
(in-process and as `deskfleet agent --headless --join-file PATH` without --console)."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import replace

import pytest
from zeroconf import ServiceInfo

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from engine.discovery.join_service import (
    CONSOLE_SERVICE_TYPE,
    ConsoleAdvertisement,
    async_find_consoles,
    console_advertisement,
    matching,
)
from engine.errors import DiscoveryError, EnrollmentError, JoinTokenError
from engine.trust.fleet_ca import FleetAuthority
from engine.trust.join_token import JoinToken
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import run

FP = "ab" * 32


def _ad(**over) -> ConsoleAdvertisement:
    return replace(console_advertisement("Admin PC", FP, 7411, "127.0.0.1", "0.1.0"), **over)


def _info(ad: ConsoleAdvertisement, properties=None, port=None) -> ServiceInfo:
    return ServiceInfo(CONSOLE_SERVICE_TYPE, ad.service_name, port=port or ad.enrollment_port,
                       properties=ad.to_properties() if properties is None else properties,
                       parsed_addresses=list(ad.addresses), server=ad.service_name)


def test_the_record_round_trips_and_hostile_records_are_refused():
    ad = console_advertisement("Admin's PC (room 4.2)", FP, 7411, "127.0.0.1", "0.1.0")
    assert ad.instance == "Admin-s PC -room 4-2-" + FP[:16]
    assert ad.ca_pin == FP[:32] and ad.fleet_id == FP[:16] and ad.enrollment == "127.0.0.1:7411"
    assert ConsoleAdvertisement.from_service_info(_info(ad)) == ad
    assert console_advertisement("...", FP, 1, "127.0.0.1", "1").instance.startswith("console-")

    bad_records = [
        _info(ad, properties={**ad.to_properties(), "pin": "zz" * 16}),
        _info(ad, properties={**ad.to_properties(), "txtvers": "2"}),
        _info(ad, properties={k: v for k, v in ad.to_properties().items() if k != "fl"}),
        _info(ad, properties={**ad.to_properties(), "ver": "x" * 100}),
        ServiceInfo("_deskfleet._tcp.local.", "x._deskfleet._tcp.local.", port=1, properties={}),
    ]
    for info in bad_records:
        with pytest.raises(DiscoveryError):
            ConsoleAdvertisement.from_service_info(info)
    for over in ({"enrollment_port": 0}, {"addresses": ()}, {"addresses": ("0.0.0.0",)},
                 {"addresses": ("224.0.0.251",)}, {"ca_pin": FP[:31]}, {"instance": "a.b"}):
        with pytest.raises(DiscoveryError):
            _ad(**over)

    other = _ad(ca_pin="cd" * 16, instance="other")
    assert matching((other, ad), FP[:32].upper()) == (ad,)
    assert matching((other,), FP[:32]) == ()


def _agent(tmp_path, name="desk-1") -> AgentService:
    settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0,
                             pause_on_battery=False)
    return AgentService(tmp_path / name, settings, idle_source=FakeIdle(), power=lambda: None,
                        inventory=lambda: {"devices": [{"name": "CPU"}]})


@pytest.mark.slow
def test_an_agent_finds_the_console_by_the_tokens_pin_and_joins_with_the_token_alone(tmp_path, private_keyring):
    async def main():
        async with console(tmp_path / "console", advertise_on="127.0.0.1", name="Admin PC") as con:
            found = await async_find_consoles("127.0.0.1", pin=con.authority.fingerprint[:32], timeout=10)
            ours = matching(found, con.authority.fingerprint[:32])
            assert [c.enrollment for c in ours] == [con.enrollment]
            assert ours[0].fleet_id == con.authority.fleet_id

            agent = _agent(tmp_path)
            await agent.async_start()
            try:
                with pytest.raises(JoinTokenError):  # a typo is caught before any search
                    await agent.async_join(None, "DFJ1-nonsense")
                foreign = JoinToken.new(FleetAuthority.create("elsewhere").fingerprint).text
                with pytest.raises(EnrollmentError, match="no console of fleet"):
                    await agent.async_join(None, foreign, timeout=4)
                assert not agent.joined
                creds = await agent.async_join(None, con.token())
                assert creds.fleet_id == con.authority.fleet_id and agent.joined
                assert agent.status().state == "idle"
            finally:
                await agent.async_close()
        # the console withdrew its record on close
        assert matching(await async_find_consoles("127.0.0.1", timeout=2.5), con.authority.fingerprint[:32]) == ()

    run(main(), timeout=120)


@pytest.mark.slow
def test_headless_agent_joins_with_only_the_token(tmp_path):
    env = {**os.environ, "DESKFLEET_KEYRING_DIR": str(tmp_path / "keyring")}

    async def main():
        async with console(tmp_path / "console", advertise_on="127.0.0.1") as con:
            (tmp_path / "token").write_text(con.token())
            (tmp_path / "token").chmod(0o600)  # a token file others may read is refused (agent.service.join_file)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "engine.cli.main", "agent", "--headless", "--state-dir", str(tmp_path / "a"),
                "--interface", "127.0.0.1", "--control-port", "0", "--data-port", "0",
                "--join-file", str(tmp_path / "token"),
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            lines = []
            try:
                async with asyncio.timeout(90):
                    while not any("; control port" in line for line in lines):
                        line = (await proc.stdout.readline()).decode()
                        assert line, "".join(lines)
                        lines.append(line)
            finally:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 30)
            return "".join(lines), con.authority.fleet_id

    output, fleet_id = run(main(), timeout=150)
    assert "looking for the fleet's console" in output
    assert f"joined fleet {fleet_id}" in output and "deskfleet agent: idle" in output
