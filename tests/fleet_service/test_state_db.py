"""The fleet service's state database: a state dir written by the JSON-file release comes up in
the real service with every agent, tag, revocation, admin certificate, token, key, ring and
placement intact (its files kept as a backup, imported once); a damaged or newer database is
refused by name, never read as empty; a change is all or nothing."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from console.fleet.admin_certs import AdminCertBook
from console.fleet.agent_tags import TagBook
from console.fleet.approvals import ApprovalBook
from console.fleet.errors import FleetStateError
from console.fleet.placement_store import PlacementStore
from console.fleet.revocations import RevocationBook
from console.fleet.served_rings import ServedRings
from engine.errors import DeskfleetError
from engine.state.db import DB_FILE, SCHEMA_VERSION, StateDB, StateDBError
from engine.state.legacy import BACKUP_DIR, IMPORTERS
from engine.trust.join_token import TokenBook, parse_token
from engine.trust.key_book import KeyBook
from tests.fleet_service.admin import Admin
from tests.fleet_service.conftest import service_in_process
from tests.support.asyncutil import run

FIXTURE = Path(__file__).parent / "fixtures" / "state_before_sqlite"  # made by make_state_before_sqlite.py
NODES = [f"{i:x}" * 64 for i in range(1, 5)]


def _old_state(tmp_path: Path) -> Path:
    state = tmp_path / "fleet"
    shutil.copytree(FIXTURE, state)
    state.chmod(0o700)
    return state


def test_a_state_dir_of_the_json_release_comes_up_in_the_service_with_everything_intact(tmp_path):
    state = _old_state(tmp_path)
    originals = {name: (state / name).read_text() for name, _ in IMPORTERS if (state / name).exists()}

    async def main():
        async with service_in_process(state) as service, Admin.unix(state / "admin.sock") as a:
            keys = {k["name"]: k for k in (await a.ok("GET", "/keys"))["keys"]}
            tokens = (await a.ok("GET", "/tokens"))["tokens"]
            rings = {r["ring"] for r in (await a.ok("GET", "/rings"))["rings"]}
            certs = {c["name"]: c["state"] for c in (await a.ok("GET", "/admin-certs"))["admin_certs"]}
            assert "p1" in service.placements
        return keys, tokens, rings, certs

    keys, tokens, rings, certs = run(main(), 120)
    assert {"alice", "wiki-bot", f"tray-desk-0-{NODES[0][:8]}"} <= set(keys) and "mallory" not in keys  # live only
    assert keys["alice"]["rpm"] == 60 and keys["alice"]["tpm"] == 20000 and keys["wiki-bot"]["metrics"] is True
    assert keys[f"tray-desk-0-{NODES[0][:8]}"]["node_id"] == NODES[0]
    roll_out = next(t for t in tokens if t["label"] == "floor 2 roll-out")
    assert (roll_out["used"], roll_out["uses"], roll_out["expires_at"]) == (2, 5, None)
    assert [a["name"] for a in roll_out["admitted"]] == ["desk-0", "desk-1"]
    assert rings == {"r1", "r2"}
    assert certs == {"alice": "active", "bob": "revoked"}

    # the old files moved to the backup, unchanged; the import is recorded and never runs again
    assert all((state / BACKUP_DIR / name).read_text() == text for name, text in originals.items())
    assert not any((state / name).exists() for name in originals)
    (state / "approved-agents.json").write_text(originals["approved-agents.json"].replace("desk-0", "changed"))
    StateDB.forget(state)

    approvals = ApprovalBook(state).approved
    assert sorted(approvals) == NODES[:3] and approvals[NODES[0]].name == "desk-0"  # not imported twice
    assert approvals[NODES[2]].control_port == 7212 and approvals[NODES[1]].address == "10.0.0.11"
    tags = TagBook(state)
    assert tags.get(NODES[0]).effective == ("floor-2", "lab") and tags.get(NODES[1]).set_by == "admin"
    assert NODES[3] in RevocationBook(state)
    assert {r["name"] for r in AdminCertBook(state).listing()} == {"alice", "bob"}
    served = ServedRings(state).state
    assert served.api_port == 8123 and [r.ring for r in served.rings] == ["r1", "r2"]
    r1 = served.ring("r1")
    assert r1 is not None and r1.export_id == "tiny-1" and r1.return_port == 40001 and r1.standby == (NODES[2],)
    placement = PlacementStore(state).get("p1")
    assert placement.include_tags == ("lab",) and placement.context == 2048 and placement.plan.stages

    book = KeyBook(state)
    assert book.get("mallory").revoked_at is not None  # the revoked key's record came too
    for secret in (state / "key-secrets.txt").read_text().split():
        assert book.identify(secret) is not None  # every live key still opens the API
    roll_out_text = (state / "token-texts.txt").read_text().split()[0]
    pin = parse_token(roll_out_text).ca_pin
    tokens_book = TokenBook(state / "join-tokens.json", pin)
    assert tokens_book.redeem(roll_out_text).label == "floor 2 roll-out"  # the 3rd of its 5 uses
    assert StateDB.for_dir(state).schema_version == SCHEMA_VERSION


def test_a_damaged_database_stops_the_service_by_name_and_is_left_as_it_is(tmp_path):
    state = tmp_path / "fleet"
    ApprovalBook(state).add(NODES[0], "desk-0", "10.0.0.10", 7210, "f" * 64)
    StateDB.forget(state)
    path = state / DB_FILE
    damaged = path.read_bytes()[:100] + b"\x5a" * 5000  # the header survives, the pages do not
    path.write_bytes(damaged)

    async def main():
        with pytest.raises(DeskfleetError, match=f"{DB_FILE} is damaged"):
            async with service_in_process(state):
                raise AssertionError("the service started over a damaged state database")

    run(main(), 60)
    assert path.read_bytes() == damaged
    with pytest.raises(FleetStateError, match="restore the file"):
        ApprovalBook(state)


def test_a_database_from_a_newer_release_is_refused(tmp_path):
    StateDB.for_dir(tmp_path)
    StateDB.forget(tmp_path)
    conn = sqlite3.connect(tmp_path / DB_FILE, isolation_level=None)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    conn.close()
    with pytest.raises(StateDBError, match=f"schema version {SCHEMA_VERSION + 1}.*newer"):
        StateDB.for_dir(tmp_path)


def test_a_change_is_all_or_nothing_and_other_processes_see_it_once_committed(tmp_path):
    db = StateDB.for_dir(tmp_path)
    with pytest.raises(RuntimeError), db.transaction():
        db.put_approval(NODES[0], "desk-0", "10.0.0.10", 7210, "f" * 64, "t")
        db.put_served_ring("r1", {"ring": "r1"})
        raise RuntimeError("a crash mid-change")
    assert db.approvals() == [] and db.served_rings() == []
    with db.transaction():
        db.put_approval(NODES[0], "desk-0", "10.0.0.10", 7210, "f" * 64, "t")
    other = StateDB(tmp_path)  # a second connection, as another process has
    try:
        assert [a["name"] for a in other.approvals()] == ["desk-0"]
    finally:
        other.close()


def test_an_empty_state_dir_gets_a_database_and_no_backup(tmp_path):
    db = StateDB.for_dir(tmp_path / "new")
    assert db.path.is_file() and not (tmp_path / "new" / BACKUP_DIR).exists()
    assert (db.path.stat().st_mode & 0o777) == 0o600
    assert json.loads(json.dumps(db.api_keys())) == []


def test_the_model_list_calibrations_and_failover_count_are_imported_too(tmp_path):
    from console.fleet.failover_tally import FailoverTally
    from console.fleet.models import ModelLibrary
    from console.fleet.profiling import ProfileCache

    checkpoint = tmp_path / "ckpt.gguf"
    (tmp_path / "models.json").write_text(json.dumps({"models": [str(checkpoint)]}))
    (tmp_path / "device-profiles.json").write_text(json.dumps({"format": 1, "profiles": {
        "m|n1|CPU": {"layer_ms": 2.5, "overhead_ms": 0.5, "timings": []}}}))
    (tmp_path / "failovers.json").write_text("{damaged")  # a day's dashboard count: not worth a stop
    assert [m.path for m in ModelLibrary(tmp_path).models()[1:]] == [checkpoint]
    assert ProfileCache(tmp_path).get("m", "n1", "CPU") == (2.5, 0.5)
    assert FailoverTally(tmp_path).today() == 0
    assert (tmp_path / BACKUP_DIR / "models.json").is_file() and not (tmp_path / "failovers.json").exists()
