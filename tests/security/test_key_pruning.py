"""Issue 29, L11: revoked keys do not pile up in the key book for ever. A fleet whose PCs come and
go revokes a tray key per removed PC; the book forgets a key revoked more than KEEP_REVOKED_DAYS
ago (the service does it hourly, ``deskfleet keys prune`` on demand), keeps the recently revoked
ones (who held what, for the usage and the audit) and never touches a live key."""

from __future__ import annotations

import datetime as dt

from engine.cli.main import main
from engine.control.fleet_services import CA_CERT, CA_KEY
from engine.trust.key_book import KEEP_REVOKED_DAYS, KeyBook


def test_keys_revoked_longer_ago_than_the_retention_are_forgotten_live_ones_never(tmp_path, capsys):
    book = KeyBook(tmp_path)
    live = book.issue("alice")
    trays = [book.issue(f"tray-pc{i}-0000000{i}", node_id=f"{i}" * 64) for i in range(50)]
    for i in range(50):
        book.revoke_member(f"{i}" * 64)
    assert len(book.keys()) == 51
    now = dt.datetime.now(dt.UTC)
    assert book.prune_revoked(now=now + dt.timedelta(days=KEEP_REVOKED_DAYS - 1)) == ()  # still recent
    pruned = book.prune_revoked(now=now + dt.timedelta(days=KEEP_REVOKED_DAYS + 1))
    assert sorted(pruned) == sorted(t.key.name for t in trays)
    assert [k.name for k in book.keys()] == ["alice"] and book.identify(live.secret).name == "alice"
    assert book.prune_revoked(now=now + dt.timedelta(days=10 * KEEP_REVOKED_DAYS)) == ()  # a live key stays

    book.issue("bob")
    book.revoke("bob")
    for name in (CA_CERT, CA_KEY):  # a fleet's folder (`deskfleet keys` refuses one without a fleet)
        (tmp_path / name).write_text("")
    assert main(["keys", "--state-dir", str(tmp_path), "prune", "--days", "0"]) == 0
    assert "1 revoked key(s) forgotten: bob" in capsys.readouterr().err
    assert book.get("bob") is None and book.get("alice") is not None
