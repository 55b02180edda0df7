"""``sudo deskfleet keys … --state-dir DIR`` on a service's state dir (issue 29, L10): the change runs as
the directory's owner, so the book stays the service's, and links its owner planted are not followed
as root. Run as root on a sandbox dir of a throwaway uid (no account added; the sandbox removed)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.control.fleet_services import CA_CERT, CA_KEY
from engine.state.db import DB_FILE
from engine.trust.key_book import KeyBook

pytestmark = pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="root on another user's state dir")


@pytest.fixture
def owned_dir():
    uid = next(u for u in range(61000, 62000) if not _has_account(u))
    sandbox = Path(tempfile.mkdtemp(prefix="deskfleet-owner-"))  # root's, 0700: the owner cannot cross it
    state = sandbox / "state"
    state.mkdir(mode=0o700)
    os.chown(state, uid, uid)
    try:
        yield sandbox, state, uid
    finally:
        shutil.rmtree(sandbox)


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_root_changes_another_users_key_book_as_that_user(owned_dir, capsys):
    sandbox, state, uid = owned_dir
    for name in (CA_CERT, CA_KEY):  # a fleet's state dir (`keys` refuses one without a fleet)
        (state / name).write_text("")
        os.chown(state / name, uid, uid)
    # the owner (the service's user) planted a link where root would create the state database
    (state / DB_FILE).symlink_to(sandbox / "made-by-root")
    assert main(["keys", "--state-dir", str(state), "issue", "alice"]) == 1
    assert DB_FILE in capsys.readouterr().err
    assert not (sandbox / "made-by-root").exists()  # root would have created it through the link
    (state / DB_FILE).unlink()

    assert main(["keys", "--state-dir", str(state), "issue", "alice", "--rpm", "5"]) == 0
    secret = capsys.readouterr().out.strip()
    book = state / DB_FILE
    assert (book.stat().st_uid, book.stat().st_gid) == (uid, uid)  # the service can still read it
    assert book.stat().st_mode & 0o777 == 0o600
    assert KeyBook(state).identify(secret).name == "alice"
    assert main(["keys", "--state-dir", str(state), "list", "--json"]) == 0
    assert [k["name"] for k in json.loads(capsys.readouterr().out)] == ["alice"]
    assert main(["keys", "--state-dir", str(state), "revoke", "alice"]) == 0
    assert "revoked at" in capsys.readouterr().err and KeyBook(state).identify(secret) is None
    assert {p.stat().st_uid for p in state.iterdir()} == {uid}


def test_root_issues_an_admin_certificate_from_another_users_fleet_and_the_record_stays_theirs(owned_dir,
                                                                                              monkeypatch, capsys):
    from console.fleet.admin_certs import AdminCertBook
    from engine.control.fleet_services import load_or_create_authority
    from engine.envvars import KEYRING_DIR
    from engine.trust.admin_bundle import read_admin_credentials
    from engine.trust.keystore import ConsoleSecrets

    sandbox, state, uid = owned_dir
    monkeypatch.delenv(KEYRING_DIR, raising=False)  # a system service's: the file keyring in the state dir
    monkeypatch.setenv("HOME", str(sandbox))
    load_or_create_authority(state, secrets_=ConsoleSecrets(state))
    for path in (state, *state.iterdir()):
        os.chown(path, uid, uid)
    out = sandbox / "alice"
    assert main(["fleet", "admin-cert", "alice", "--out", str(out), "--state-dir", str(state)]) == 0
    assert read_admin_credentials(out).name == "alice" and (out / "admin.key").stat().st_uid == 0  # root's folder
    record = state / DB_FILE
    assert (record.stat().st_uid, record.stat().st_mode & 0o777) == (uid, 0o600)  # the service can read it
    assert [r["name"] for r in AdminCertBook(state).listing()] == ["alice"]
    assert {p.stat().st_uid for p in state.iterdir()} == {uid}
