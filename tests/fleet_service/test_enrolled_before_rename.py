"""An agent that joined before the server was renamed "the fleet service" keeps working.

What an enrolled fleet holds on disk was written by the old code: the service's certificate with
the role (OU) "console" in ``console.crt``/``console.key`` beside the CA, and the agent's
``state.json`` pinning that certificate under the key ``console_node_id``. Those are built here
with the same CA code and the old file names and keys (the state file as a literal, exactly as
the old ``AgentState.to_dict`` wrote it); then the real fleet service and the real agent service
of this tree start over them, on loopback with real TLS, and the service reaches the agent,
reads its status and has it serve a stage of a ring.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from agent.service.service import AgentService
from agent.service.settings import SETTINGS_FILE, STATE_FILE, AgentSettings, AgentState, load_settings, load_state
from engine.control.enrollment import CONSOLE_CERT, CONSOLE_KEY, load_or_create_console_credentials
from engine.control.fleet_services import load_or_create_authority
from engine.envvars import KEYRING_DIR
from engine.trust.fleet_ca import Credentials, Role
from engine.trust.keystore import KeyStore
from tests.fleet_service.admin import Admin
from tests.fleet_service.conftest import service_in_process
from tests.support.agent_helpers import FakeIdle

EXPORT_ID = "tiny-1"


def _old_state_json(service_node_id: str) -> dict:
    """``state.json`` as an agent wrote it at its join before the rename (every key the old
    ``AgentState`` had, the pin under its old name)."""
    return {"assignment": None, "serving": False, "manually_paused": False, "remotely_paused": False,
            "api_url": None, "console_node_id": service_node_id, "deny": [], "chat_key": None}


def _ou(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return str(cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value)


def test_the_old_role_name_is_the_new_one_on_the_wire_and_in_certificates():
    assert Role.CONSOLE is Role.FLEET_SERVICE and Role("console") is Role.FLEET_SERVICE
    assert Role.FLEET_SERVICE.value == "console"  # the OU every enrolled fleet's service certificate holds


def test_an_agent_state_file_written_before_the_rename_keeps_its_pin(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps(_old_state_json("ab" * 32)))
    assert load_state(tmp_path).service_node_id == "ab" * 32
    both = {**_old_state_json("ab" * 32), "service_node_id": "cd" * 32}  # the new key wins over the old
    assert AgentState.from_dict(both).service_node_id == "cd" * 32


def _enrolled_before(root: Path) -> tuple[Path, Path, Credentials]:
    """A fleet service's state dir and an agent's, as the old code left them after the agent's
    join: the CA, the service's certificate (role "console") in the old file names, the agent's
    certificate in its keyring and its state file pinning the service under the old key."""
    service_dir, agent_dir = root / "fleet", root / "desk-old"
    authority = load_or_create_authority(service_dir)
    service_creds = load_or_create_console_credentials(service_dir, authority)
    assert (service_dir / CONSOLE_CERT).exists() and (service_dir / CONSOLE_KEY).exists()
    settings = AgentSettings(name="desk-old", interface="127.0.0.1", control_port=0, data_port=0, warm_spare="off")
    agent_dir.mkdir(parents=True)
    (agent_dir / SETTINGS_FILE).write_text(json.dumps(settings.to_dict()))
    KeyStore(f"agent-{settings.instance}").save(authority.issue_credentials("desk-old", role=Role.AGENT))
    (agent_dir / STATE_FILE).write_text(json.dumps(_old_state_json(service_creds.node_id)))
    return service_dir, agent_dir, service_creds


async def _until(predicate, timeout: float, what: str):
    """``predicate()``'s first truthy value (awaited), polled; a hang guard of ``timeout`` s."""
    try:
        async with asyncio.timeout(timeout):
            while not (value := await predicate()):
                await asyncio.sleep(0.2)
            return value
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@pytest.mark.slow
def test_an_agent_joined_before_the_rename_connects_reports_and_serves(tmp_path, monkeypatch, tiny_export):
    monkeypatch.setenv(KEYRING_DIR, str(tmp_path / "keyring"))
    service_dir, agent_dir, service_creds = _enrolled_before(tmp_path)
    assert _ou(service_creds.cert_pem) == "console"
    (service_dir / "exports").mkdir()
    shutil.copytree(tiny_export("llama", 1), service_dir / "exports" / EXPORT_ID)

    async def main():
        async with service_in_process(service_dir) as service:
            # the service of this tree took the certificate the agent pinned, not a new one
            assert service.host.credentials.node_id == service_creds.node_id
            assert service.host.credentials.role is Role.FLEET_SERVICE
            pc = AgentService(agent_dir, load_settings(agent_dir), idle_source=FakeIdle(1e6), power=lambda: None)
            await pc.async_start()
            try:
                assert pc.joined and pc.service_node_id == service_creds.node_id
                async with Admin.unix(service_dir / "admin.sock") as admin:
                    # it connects: the service probes it over mutual TLS and it proves its node id
                    added = (await admin.ok("POST", "/agents", {"host": "127.0.0.1", "port": pc.control_port}))["agent"]
                    assert added["node_id"] == pc.status().node_id
                    await admin.ok("POST", f"/agents/{added['key']}/approve")

                    async def reported():
                        agents = (await admin.ok("GET", "/agents"))["agents"]
                        return next((a for a in agents if a["key"] == added["key"] and a["verified"]
                                     and a["approved"] and a["status"] is not None and a["state"] == "idle"), None)

                    # it reports its status: the service's polls (orders of a pinned service) answer
                    record = await _until(reported, 30, "the service to read the agent's status")
                    assert record["name"] == "desk-old"
                    # it can be assigned work: a one-stage ring on it, brought up and tested
                    node = added["node_id"]
                    plan = {"stages": [{"device_id": f"{node}/CPU", "pc_id": node, "first_layer": 0,
                                        "last_layer": 3}]}
                    made = await admin.ok("POST", "/rings", {"plan": plan, "export_id": EXPORT_ID})
                    job = await admin.job(made["job"]["id"], 180)
                    assert job["state"] == "done", job
                    ring = (await admin.ok("GET", f"/rings/{made['ring']['ring']}"))["ring"]
                    assert ring["phase"] == "serving", ring
                    assert pc.assignment is not None and pc.assignment.export_id == EXPORT_ID
                    assert pc.status().state == "serving"
            finally:
                await pc.async_close()

    asyncio.run(main())
