"""The JSON files older versions kept in a state dir, imported into the state database once.

Before the database (:mod:`engine.state.db`) every concept had its own file, rewritten whole and
renamed on each change. The database's first open in a state dir reads each file that exists,
checks its format as the old code did, and puts every record in the database within the same
transaction that creates the schema: a file that does not parse stops the import (nothing is
half-imported; the files stay where they are and the error names the one to repair). Afterwards
the files move to ``json-before-sqlite/`` beside the database: a backup, and the proof the import
ran (the database records it too, so it never runs twice).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from engine.errors import StateDBError

log = logging.getLogger("deskfleet.state")

BACKUP_DIR = "json-before-sqlite"
APPROVALS_FILE = "approved-agents.json"
TAGS_FILE = "agent-tags.json"
REVOKED_FILE = "revoked-agents.json"
ADMIN_CERTS_FILE = "admin-certs.json"
SERVED_FILE = "served-rings.json"
PLACEMENTS_FILE = "placements.json"
TOKENS_FILE = "join-tokens.json"
KEYS_FILE = "api-keys.json"
MODELS_FILE = "models.json"
PROFILES_FILE = "device-profiles.json"
FAILOVERS_FILE = "failovers.json"
TOKENS_FORMAT, TOKENS_FORMAT_V1 = "deskfleet-join-tokens/2", "deskfleet-join-tokens/1"
KEYS_FORMAT = "deskfleet-api-keys/1"
# the lock files the old writers held beside their files: moved with them
LOCK_FILES = ("api-keys.lock", "admin-certs.json.lock", "join-tokens.json.lock")


class StateDB(Protocol):
    """What the import writes through: :class:`engine.state.db.StateDB`'s typed functions."""

    state_dir: Path
    path: Path

    def put_approval(self, node_id: str, name: str, address: str, control_port: int, fleet_id: str,
                     approved_at: str) -> None: ...

    def put_agent_tags(self, node_id: str, reported: list[str], admin: list[str] | None) -> None: ...

    def add_revocation(self, node_id: str, name: str, revoked_at: str) -> None: ...

    def put_admin_cert(self, fingerprint: str, record: Mapping[str, Any]) -> None: ...

    def put_served_ring(self, ring: str, doc: Mapping[str, Any]) -> None: ...

    def set_setting(self, name: str, value: Any) -> None: ...

    def put_placement(self, placement_id: str, doc: Mapping[str, Any]) -> None: ...

    def put_join_token(self, secret_hash: str, entry: Mapping[str, Any]) -> None: ...

    def add_admission(self, secret_hash: str, node_id: str, name: str, at: float) -> None: ...

    def put_api_key(self, doc: Mapping[str, Any]) -> None: ...


def _read(state_dir: Path, name: str) -> dict[str, Any] | None:
    path = state_dir / name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateDBError(f"{path} (from before the state database) cannot be read ({exc}); nothing was imported "
                           "and it was left in place: repair it or move it aside, then start again") from exc
    if not isinstance(data, dict):
        raise StateDBError(f"{path} (from before the state database) is not a JSON object; nothing was imported: "
                           "repair it or move it aside, then start again")
    return data


def _require(doc: dict[str, Any], keys: tuple[str, ...]) -> None:
    """What the old reader required of an entry (the rest is checked where the entry is read)."""
    if missing := [k for k in keys if k not in doc]:
        raise ValueError(f"an entry has no {', '.join(missing)}")


def _approvals(db: StateDB, data: dict[str, Any]) -> int:
    agents = data["agents"] if data.get("format") == 1 else None
    for node_id, e in dict(agents).items():  # type: ignore[arg-type]  # None: TypeError, reported as damaged
        db.put_approval(node_id, str(e["name"]), str(e["address"]), int(e["control_port"]), str(e["fleet_id"]),
                        str(e["approved_at"]))
    return len(agents)  # type: ignore[arg-type]


def _tags(db: StateDB, data: dict[str, Any]) -> int:
    agents = data["agents"] if data.get("format") == 1 else None
    for node_id, e in dict(agents).items():  # type: ignore[arg-type]
        admin = e.get("admin")
        db.put_agent_tags(node_id, [str(t) for t in e.get("reported", [])],
                          None if admin is None else [str(t) for t in admin])
    return len(agents)  # type: ignore[arg-type]


def _revoked(db: StateDB, data: dict[str, Any]) -> int:
    revoked = data["revoked"] if data.get("format") == 1 else None
    for node_id, e in dict(revoked).items():  # type: ignore[arg-type]
        if not re.fullmatch(r"[0-9a-f]{64}", node_id):
            raise ValueError(f"{node_id!r} is not a node id")
        db.add_revocation(node_id, str(e.get("name", "")), str(e.get("revoked_at", "")))
    return len(revoked)  # type: ignore[arg-type]


def _admin_certs(db: StateDB, data: dict[str, Any]) -> int:
    certs = data["certs"] if data.get("format") == 1 else None
    for fingerprint, record in dict(certs).items():  # type: ignore[arg-type]
        if not isinstance(record.get("not_after"), str):
            raise ValueError(f"certificate {fingerprint[:16]} has no not_after")
        db.put_admin_cert(fingerprint, record)
    return len(certs)  # type: ignore[arg-type]


def _served(db: StateDB, data: dict[str, Any]) -> int:
    if data.get("format") != 1:
        raise ValueError(f"format {data.get('format')!r}, this version reads 1")
    rings = list(data.get("rings") or ())
    for ring in rings:
        _require(ring, ("ring", "model", "plan"))
        db.put_served_ring(str(ring["ring"]), ring)
    db.set_setting("api_port", int(data.get("api_port") or 0))
    return len(rings)


def _placements(db: StateDB, data: dict[str, Any]) -> int:
    if data.get("format") != 1:
        raise ValueError(f"format {data.get('format')!r}, this version reads 1")
    items = list(data.get("placements") or ())
    for placement in items:
        _require(placement, ("id", "model", "context", "inputs", "plan"))
        db.put_placement(str(placement["id"]), placement)
    return len(items)


def _token_v1(entry: dict[str, Any]) -> dict[str, Any]:
    """A format-1 (single-use) token entry in format 2."""
    used_at = entry.get("used_at")
    return {"label": "", "issued_at": float(entry.get("issued_at") or entry["expires_at"]),
            "expires_at": float(entry["expires_at"]), "uses": 1, "used": 0 if used_at is None else 1,
            "auto_approve": False, "revoked_at": None, "last_used_at": used_at, "admitted": []}


def _tokens(db: StateDB, data: dict[str, Any]) -> int:
    if data.get("format") not in (TOKENS_FORMAT, TOKENS_FORMAT_V1) or not isinstance(data.get("tokens"), dict):
        raise ValueError(f"not a {TOKENS_FORMAT} document")
    for secret_hash, entry in data["tokens"].items():
        if data["format"] == TOKENS_FORMAT_V1:
            entry = _token_v1(entry)
        if len(secret_hash) != 64 or not 0 <= int(entry["used"]) <= int(entry["uses"]):
            raise ValueError(f"entry {secret_hash[:12]}... is damaged")
        db.put_join_token(secret_hash, {**entry, "auto_approve": bool(entry["auto_approve"]),
                                        "last_used_at": entry.get("last_used_at")})
        for a in entry["admitted"]:
            db.add_admission(secret_hash, str(a["node_id"]), str(a["name"]), float(a["at"]))
    return len(data["tokens"])


def _keys(db: StateDB, data: dict[str, Any]) -> int:
    if data.get("format") != KEYS_FORMAT:
        raise ValueError(f"not a {KEYS_FORMAT} document")
    keys = list(data["keys"])
    names = set()
    for doc in keys:
        sha = str(doc["sha256"])
        if len(sha) != 64 or doc["name"] in names:
            raise ValueError(f"key {doc['name']!r} has no valid sha256, or appears twice")
        names.add(doc["name"])
        db.put_api_key(doc)
    return len(keys)


def _models(db: StateDB, data: dict[str, Any]) -> int:
    models = [str(p) for p in data.get("models") or () if isinstance(p, str)]
    db.set_setting("models", models)
    return len(models)


def _profiles(db: StateDB, data: dict[str, Any]) -> int:
    if data.get("format") != 1 or not isinstance(data.get("profiles"), dict):
        raise ValueError("not format 1 with a 'profiles' object")
    db.set_setting("device_profiles", data["profiles"])
    return len(data["profiles"])


def _failovers(db: StateDB, data: dict[str, Any]) -> int:
    if isinstance(data.get("day"), str) and isinstance(data.get("count"), int):
        db.set_setting("failover_tally", {"day": data["day"], "count": data["count"]})
    return 1


IMPORTERS: tuple[tuple[str, Callable[[StateDB, dict[str, Any]], int]], ...] = (
    (APPROVALS_FILE, _approvals), (TAGS_FILE, _tags), (REVOKED_FILE, _revoked), (ADMIN_CERTS_FILE, _admin_certs),
    (SERVED_FILE, _served), (PLACEMENTS_FILE, _placements), (TOKENS_FILE, _tokens), (KEYS_FILE, _keys),
    (MODELS_FILE, _models), (PROFILES_FILE, _profiles), (FAILOVERS_FILE, _failovers))
LENIENT = frozenset({FAILOVERS_FILE})  # a day's count for the dashboard: a damaged one is counted from 0


def import_legacy(db: StateDB) -> dict[str, int]:
    """Put every record of the state dir's old JSON files into ``db`` (inside the caller's
    transaction); file name -> records imported. StateDBError naming a file that does not parse."""
    counts = {}
    for name, importer in IMPORTERS:
        try:
            data = _read(db.state_dir, name)
        except StateDBError as exc:
            if name not in LENIENT:
                raise
            log.warning("%s; not imported", exc)
            continue
        if data is None:
            continue
        try:
            counts[name] = importer(db, data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateDBError(f"{db.state_dir / name} (from before the state database) is damaged ({exc}); "
                               "nothing was imported and it was left in place: restore it from a backup or move "
                               "it aside, then start again") from exc
    if counts:
        log.warning("imported the fleet's state from its JSON files into %s: %s", db.path,
                    ", ".join(f"{n} ({c})" for n, c in counts.items()))
    return counts


def back_up_legacy(state_dir: Path) -> None:
    """Move the imported JSON files (and their lock files) to ``json-before-sqlite/``."""
    names = [n for n, _ in IMPORTERS] + list(LOCK_FILES)
    present = [n for n in names if (state_dir / n).exists()]
    if not present:
        return
    backup = state_dir / BACKUP_DIR
    try:
        backup.mkdir(mode=0o700, exist_ok=True)
        for name in present:
            os.replace(state_dir / name, backup / name)
    except OSError as exc:  # imported already (the database says so): the files are only a backup
        log.warning("the JSON files imported into the state database stay in %s (%s)", state_dir, exc)
