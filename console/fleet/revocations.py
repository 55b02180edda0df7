"""Members the admin removed: their node ids, kept in the fleet service's state dir (the deny list).

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

from console.fleet.errors import FleetStateError
from console.fleet.state_file import read_json, write_json

REVOKED_FILE = "revoked-agents.json"
FORMAT = 1
_WHAT = "the revoked-agents list"
_NODE_ID = re.compile(r"[0-9a-f]{64}")


class RevocationBook:
    """Revoked node ids (with when and the name they had), persisted in ``state_dir / REVOKED_FILE``."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / REVOKED_FILE
        self._revoked = self._load()

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
        revoked = {**self._revoked, node_id: entry}
        write_json(self.path, {"format": FORMAT, "revoked": revoked}, _WHAT)
        self._revoked = revoked

    def _load(self) -> dict[str, dict[str, str]]:
        data = read_json(self.path, _WHAT)
        if data is None:
            return {}
        revoked = data.get("revoked")
        if data.get("format") != FORMAT or not isinstance(revoked, dict) or not all(
                isinstance(k, str) and _NODE_ID.fullmatch(k) and isinstance(v, dict) for k, v in revoked.items()):
            raise FleetStateError(f"{_WHAT} in {self.path} is not format {FORMAT} with a 'revoked' object of "
                                    "node ids; it was left in place: restore it from a backup (moving it aside "
                                    "would let the removed PCs back in)")
        return revoked
