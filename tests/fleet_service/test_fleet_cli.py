"""``deskfleet fleet``'s local tools and packaging: admin-cert issues an admin certificate from the
state dir's fleet CA (refused where there is no fleet), the settings parse the command line, the
Windows per-user start writes and removes its Run value (a recording stand-in for winreg: this
machine is not Windows), and the .deb carries the systemd unit, which ``systemd-analyze verify``
accepts where the tool exists."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from console.fleet.admin_certs import write_admin_certificate
from console.fleet.cli import (
    RUN_KEY,
    RUN_VALUE_NAME,
    configure,
    disable_windows_start,
    enable_windows_start,
    service_settings,
    windows_run_value,
)
from console.fleet_api.errors import FleetServiceError
from engine.control.fleet_services import load_or_create_authority
from engine.errors import DeskfleetError
from engine.trust.admin_bundle import read_admin_credentials
from engine.trust.fleet_ca import Role
from engine.trust.keystore import ConsoleSecrets
from installer.build_deb import FLEET_UNIT, stage_package
from installer.packaging import REPO

pytestmark = pytest.mark.usefixtures("private_keyring")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_admin_cert_comes_from_the_fleet_ca_of_the_state_dir(tmp_path):
    with pytest.raises(FleetServiceError, match="no fleet"):
        write_admin_certificate(tmp_path / "empty", "alice", tmp_path / "out")
    state = tmp_path / "fleet"
    authority = load_or_create_authority(state, secrets_=ConsoleSecrets(state))
    folder = write_admin_certificate(state, "alice", tmp_path / "alice")
    creds = read_admin_credentials(folder)
    assert creds.role is Role.ADMIN and creds.name == "alice" and creds.ca_fingerprint == authority.fingerprint
    # recorded, listed and revocable from the shell (issue 29, M7); a life over the bound is refused
    from console.fleet.admin_certs import AdminCertBook
    from console.fleet.cli import run as run_fleet
    from engine.trust.fleet_ca import peer_node_id

    fingerprint = peer_node_id(creds.certificate.public_bytes(Encoding.DER))
    assert [(r["fingerprint"], r["name"], r["state"]) for r in AdminCertBook(state).listing()] == \
        [(fingerprint, "alice", "active")]
    assert run_fleet(_args("admin-cert", "--list", "--state-dir", str(state))) == 0
    assert run_fleet(_args("admin-cert", "--revoke", fingerprint[:10], "--state-dir", str(state))) == 0
    assert AdminCertBook(state).listing()[0]["state"] == "revoked"
    with pytest.raises(DeskfleetError, match="397 days"):
        write_admin_certificate(state, "bob", tmp_path / "bob", days=3650)


def test_settings_from_the_command_line(tmp_path):
    s = service_settings(_args("--state-dir", str(tmp_path), "--interface", "127.0.0.1", "--api-port", "0",
                               "--admin-port", "-1", "--data-port", "0", "--threads", "2", "--exact"))
    assert s.state_dir == tmp_path and s.admin_port is None and s.fleet.api_port == 0
    assert s.fleet.data_port == 0 and s.fleet.worker.threads == 2 and s.fleet.worker.exact
    assert service_settings(_args("--interface", "127.0.0.1", "--admin-host", "10.0.0.5")).admin_host == "10.0.0.5"
    assert s.browse and s.advertise and s.advertise_api  # mDNS by default
    quiet = service_settings(_args("--interface", "127.0.0.1", "--no-mdns"))
    assert not (quiet.browse or quiet.advertise or quiet.advertise_api)
    for bad in (("--api-port", "70000"), ("--admin-port", "-2")):
        with pytest.raises(DeskfleetError, match=bad[0]):
            service_settings(_args("--interface", "127.0.0.1", *bad))


class FakeRegistry:
    """The part of winreg the per-user start uses, recording values."""

    HKEY_CURRENT_USER, KEY_SET_VALUE, REG_SZ = "HKCU", 2, 1

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], str] = {}

    class _Key:
        def __init__(self, reg, path):
            self.reg, self.path = reg, path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def CreateKey(self, root, path):  # noqa: N802 - winreg's names
        return self._Key(self, path)

    def OpenKey(self, root, path, reserved, access):  # noqa: N802
        return self._Key(self, path)

    def SetValueEx(self, key, name, reserved, kind, value):  # noqa: N802
        self.values[(key.path, name)] = value

    def DeleteValue(self, key, name):  # noqa: N802
        if (key.path, name) not in self.values:
            raise FileNotFoundError(name)
        del self.values[(key.path, name)]


def test_windows_per_user_start_writes_and_removes_its_run_value():
    reg = FakeRegistry()
    command = [r"C:\Program Files\Deskfleet\pythonw.exe", "-m", "engine.cli.main", "fleet"]
    where = enable_windows_start(command, platform="win32", winreg=reg)
    assert where.endswith(RUN_VALUE_NAME)
    assert reg.values[(RUN_KEY, RUN_VALUE_NAME)] == windows_run_value(command)
    assert reg.values[(RUN_KEY, RUN_VALUE_NAME)].startswith('"C:\\Program Files\\Deskfleet\\pythonw.exe" -m')
    assert disable_windows_start(platform="win32", winreg=reg) and not reg.values
    assert not disable_windows_start(platform="win32", winreg=reg)
    with pytest.raises(DeskfleetError, match="systemctl"):
        enable_windows_start(command, platform="linux")


def test_the_deb_carries_the_fleet_unit_and_it_verifies(tmp_path):
    root = tmp_path / "root"
    stage_package(root, "0.0.0", [], "amd64")
    unit = root / "usr/lib/systemd/system" / FLEET_UNIT
    text = unit.read_text()
    assert text == (REPO / "installer" / FLEET_UNIT).read_text()
    assert "ExecStart=/usr/bin/deskfleet fleet --state-dir /var/lib/deskfleet" in text
    assert "StateDirectory=deskfleet" in text and "Restart=always" in text
    service = {k: v for k, _, v in (line.partition("=") for line in text.split("[Service]")[1].split("[Install]")[0]
                                    .splitlines() if "=" in line and not line.startswith("#"))}
    # bounded whatever a member or key holder does (issue 29, L13): the kernel stops it, Restart= brings it back
    assert service["MemoryMax"].endswith("%") and 0 < int(service["MemoryMax"][:-1]) <= 80
    assert 0 < int(service["TasksMax"]) <= 4096
    assert service["CapabilityBoundingSet"] == "" and service["ProtectKernelLogs"] == "yes"
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here: the unit was not verified")
    # the unit names the installed wrapper; point it at this environment's deskfleet to verify the rest
    exe = shutil.which("deskfleet") or f"{sys.executable}"
    local = tmp_path / FLEET_UNIT
    local.write_text(text.replace("/usr/bin/deskfleet", exe))
    proc = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Unknown" not in proc.stderr, proc.stderr  # a misspelt key is only warned of
