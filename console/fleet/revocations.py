"""Members the admin removed: their node ids, kept in the fleet service's state database (the deny list).

A fleet certificate stays valid for its whole life (engine.trust.fleet_ca.LEAF_DAYS), so "remove" must
also take back what the certificate lets its holder do. The deny list is enforced where a
member's certificate is checked: the fleet service's hub (registrations, events, shards), the
coordinator's return port (RingPath), and every agent — its control API and its stage worker —
which get the list with each assignment and with ``POST /v1/deny``. A revoked PC comes back only
through a fresh join (a new certificate, so a new node id), which the admin hands out.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from console.fleet.fleet_state import fleet_db, state_errors
from engine.state.db import StateDB

_NODE_ID = re.compile(r"[0-9a-f]{64}")


class RevocationBook:
    """Revoked node ids (with when and the name they had), kept in the state database of ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = Path(state_dir)
        self.path = self._db.path
        with state_errors():
            self._revoked = self._db.revocations()

    @property
    def _db(self) -> StateDB:
        return fleet_db(self._state_dir)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._revoked

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The deny list, sorted (what assignments carry)."""
        return tuple(sorted(self._revoked))

    def add(self, node_id: str, name: str) -> None:
        if node_id in self._revoked or not _NODE_ID.fullmatch(node_id):
            return  # already revoked, or an agent not joined (no certificate to revoke)
        entry = {"name": name, "revoked_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        with state_errors():
            self._db.add_revocation(node_id, **entry)
        self._revoked = {**self._revoked, node_id: entry}
