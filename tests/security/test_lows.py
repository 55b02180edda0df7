"""The security review's low findings, each closed: the console's state at rest (CA key encrypted
under a keyring-held key, a 0700 directory, key files never inheriting an old mode), one console
per state directory (a lock naming its holder), and the API key generated on the first run."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from engine.control.fleet_services import (
    API_KEY_PREFIX,
    CA_KEY,
    WRAP_SECRET,
    StateDirLockedError,
    fleet_host,
    load_or_create_api_key,
    load_or_create_authority,
    state_dir_lock,
)
from engine.errors import CredentialsError
from engine.trust.fleet_ca import FleetAuthority
from engine.trust.keystore import ConsoleSecrets, FileKeyring
from tests.support.asyncutil import run

posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


pytestmark = pytest.mark.usefixtures("private_keyring")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@posix_only
def test_the_ca_key_rests_encrypted_under_a_key_the_keyring_holds(tmp_path):
    state = tmp_path / "console"
    authority = load_or_create_authority(state)
    pem = (state / CA_KEY).read_bytes()
    assert pem.startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    with pytest.raises(TypeError, match="encrypted"):  # the file alone does not give the key
        serialization.load_pem_private_key(pem, password=None)
    assert _mode(state) == 0o700 and _mode(state / CA_KEY) == 0o600
    secrets_ = ConsoleSecrets(state)
    assert isinstance(secrets_.backend, FileKeyring) and secrets_.backend.path.parent == tmp_path / "keyring"
    assert secrets_.get(WRAP_SECRET) and secrets_.get(WRAP_SECRET).encode() not in pem
    again = load_or_create_authority(state)
    assert again.fingerprint == authority.fingerprint


def test_without_its_wrapping_key_the_ca_key_is_refused_with_what_to_do(tmp_path):
    state = tmp_path / "console"
    load_or_create_authority(state)
    (tmp_path / "keyring" / "keyring.json").unlink()  # the keyring was wiped
    with pytest.raises(CredentialsError, match="not in the keyring.*restore"):
        load_or_create_authority(state)


@posix_only
def test_an_older_consoles_plaintext_0644_key_is_encrypted_and_tightened(tmp_path):
    state = tmp_path / "console"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    old = FleetAuthority.create("old fleet")
    (state / "fleet-ca.crt").write_bytes(old.ca_pem)
    (state / CA_KEY).write_bytes(old.key_pem)
    os.chmod(state / CA_KEY, 0o644)
    loaded = load_or_create_authority(state)
    assert loaded.fingerprint == old.fingerprint
    assert _mode(state) == 0o700 and _mode(state / CA_KEY) == 0o600
    assert b"ENCRYPTED" in (state / CA_KEY).read_bytes()
    assert load_or_create_authority(state).fingerprint == old.fingerprint
    assert not [p for p in state.iterdir() if p.name.endswith(".tmp")]


@posix_only
def test_without_an_os_keyring_the_secrets_stay_in_the_private_state_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("DESKFLEET_KEYRING_DIR")
    state = tmp_path / "console"
    load_or_create_authority(state)
    backend = ConsoleSecrets(state).backend
    assert isinstance(backend, FileKeyring) and backend.path == state / "keyring.json"
    assert _mode(backend.path) == 0o600 and _mode(state) == 0o700


def test_the_api_key_is_made_once_and_kept(tmp_path):
    state = tmp_path / "console"
    key = load_or_create_api_key(state)
    assert key.startswith(API_KEY_PREFIX) and len(key) >= len(API_KEY_PREFIX) + 32
    assert load_or_create_api_key(state) == key
    assert load_or_create_api_key(tmp_path / "another console") != key


_HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from engine.control.fleet_services import state_dir_lock
    with state_dir_lock(Path(sys.argv[1])):
        print("held", flush=True)
        sys.stdin.read()
""")


def test_a_second_console_on_one_state_directory_is_refused_naming_the_first(tmp_path):
    state = tmp_path / "console"
    state.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(state)], cwd=Path(__file__).parents[2],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirLockedError, match=f"pid {holder.pid}.*--state-dir"):
            with state_dir_lock(state):
                pass

        async def second_console():
            async with fleet_host(state):
                pass
        with pytest.raises(StateDirLockedError):
            run(second_console())
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
        holder.stdout.close()
    with state_dir_lock(state):  # released with its holder
        pass


def test_the_fleet_host_holds_the_lock_for_its_lifetime_and_hands_out_the_api_key(tmp_path):
    state = tmp_path / "console"

    async def scenario():
        async with fleet_host(state) as host:
            with pytest.raises(StateDirLockedError, match=f"pid {os.getpid()}"):
                with state_dir_lock(state):
                    pass
            return host.api_key

    key = run(scenario())
    assert key == load_or_create_api_key(state)
    with state_dir_lock(state):
        pass
