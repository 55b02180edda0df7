"""Damage the fleet's state database the ways a disk or a hand edit can, for the tests that show a
damaged database is refused by name (never read as empty). Raw SQL here on purpose: it is what the
product's one state module must survive, not a way it would write."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from engine.state.db import DB_FILE


def _execute(state_dir: Path, sql: str, args: tuple = ()) -> None:
    conn = sqlite3.connect(Path(state_dir) / DB_FILE, isolation_level=None)
    try:
        conn.execute(sql, args)
    finally:
        conn.close()


def damage_key_record(state_dir: Path, name: str) -> None:
    """Make the key ``name``'s stored fields unparseable."""
    _execute(state_dir, "UPDATE api_keys SET fields = '{not json' WHERE name = ?", (name,))


def damage_document(state_dir: Path, table: str) -> None:
    """Make every stored document of ``table`` (served_rings, placements) unparseable."""
    _execute(state_dir, f"UPDATE {table} SET doc = '{{not json'")  # noqa: S608 - a test's fixed table name
