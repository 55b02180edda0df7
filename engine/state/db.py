"""The fleet service's state: one SQLite database (WAL) in its state dir, and the only SQL in Deskfleet.

``fleet-state.db`` holds the approved agents, their tags, the revoked members, the admin
certificates, the join tokens and whom each admitted, the API keys (their sha256, never a
secret), the served rings, the placements and the API's usage. Each concept has typed functions
here; nothing else writes SQL. A change is a transaction (``with db.transaction():`` makes several
one), so a crash leaves the old state or the new one, and several processes on one state dir (the
service, ``deskfleet keys`` from a shell) share it under SQLite's own locking.

The CA key is not here: it stays a file, encrypted under a keyring-held wrapping key.

Opening checks the file (``PRAGMA quick_check``) and the schema version: a damaged database, or
one a newer Deskfleet wrote, raises :class:`StateDBError` naming the file; nothing here ever treats
what it cannot read as empty. The first open of a state dir imports the JSON files older versions
kept (:mod:`engine.state.legacy`), once, and moves them to ``json-before-sqlite/``.

Writes are small (a row or a few) and committed with ``synchronous=NORMAL``: in WAL mode a power
cut may lose the last commits but never corrupts the file. Callers on the event loop keep to one
small transaction; the usage recorder's roll-up runs off the loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine.errors import StateDBError
from engine.state import legacy

__all__ = ["DB_FILE", "SCHEMA_VERSION", "StateDB", "StateDBError", "UsageRecord", "UsageRow"]

DB_FILE = "fleet-state.db"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_MS = 10_000

# Each entry takes the schema from version i to i + 1; a new version appends, never edits.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE approvals (node_id TEXT PRIMARY KEY, name TEXT NOT NULL, address TEXT NOT NULL,
        control_port INTEGER NOT NULL, fleet_id TEXT NOT NULL, approved_at TEXT NOT NULL);
    CREATE TABLE agent_tags (node_id TEXT PRIMARY KEY, reported TEXT NOT NULL, admin TEXT);
    CREATE TABLE revocations (node_id TEXT PRIMARY KEY, name TEXT NOT NULL, revoked_at TEXT NOT NULL);
    CREATE TABLE admin_certs (fingerprint TEXT PRIMARY KEY, name TEXT NOT NULL, not_after TEXT NOT NULL,
        issued_at TEXT, source TEXT, revoked_at TEXT);
    CREATE TABLE join_tokens (secret_hash TEXT PRIMARY KEY, label TEXT NOT NULL, issued_at REAL NOT NULL,
        expires_at REAL, uses INTEGER NOT NULL, used INTEGER NOT NULL, auto_approve INTEGER NOT NULL,
        revoked_at REAL, last_used_at REAL);
    CREATE TABLE token_admissions (secret_hash TEXT NOT NULL REFERENCES join_tokens ON DELETE CASCADE,
        node_id TEXT NOT NULL, name TEXT NOT NULL, at REAL NOT NULL);
    CREATE INDEX token_admissions_token ON token_admissions (secret_hash);
    CREATE INDEX token_admissions_node ON token_admissions (node_id);
    CREATE TABLE api_keys (name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, issued_at TEXT NOT NULL,
        revoked_at TEXT, node_id TEXT, fields TEXT NOT NULL);
    CREATE INDEX api_keys_sha256 ON api_keys (sha256);
    CREATE TABLE key_groups (name TEXT PRIMARY KEY, day_tokens INTEGER, month_tokens INTEGER);
    CREATE TABLE served_rings (ring TEXT PRIMARY KEY, doc TEXT NOT NULL);
    CREATE TABLE placements (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
    CREATE TABLE settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE usage (id INTEGER PRIMARY KEY, at REAL NOT NULL, key TEXT NOT NULL, key_group TEXT,
        model TEXT NOT NULL, ring TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL, ttft_ms REAL, duration_ms REAL NOT NULL, status INTEGER NOT NULL);
    CREATE INDEX usage_at ON usage (at);
    CREATE TABLE usage_daily (day TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL, ring TEXT NOT NULL,
        requests INTEGER NOT NULL, errors INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL, ttft_ms_sum REAL NOT NULL, ttft_count INTEGER NOT NULL,
        duration_ms_sum REAL NOT NULL, PRIMARY KEY (day, key, model, ring));
    CREATE TABLE token_totals (scope TEXT NOT NULL, period TEXT NOT NULL, tokens INTEGER NOT NULL,
        PRIMARY KEY (scope, period));
    """,
)


@dataclass(frozen=True)
class UsageRecord:
    """One API request as the usage table keeps it (never its text). ``at``: Unix time it ended;
    ``ttft_ms`` None when no token came."""

    at: float
    key: str
    model: str
    ring: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    duration_ms: float
    status: int
    group: str | None = None


@dataclass(frozen=True)
class UsageRow:
    """Usage added up over one value of ``by`` (a key name, a model or a UTC day)."""

    value: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    mean_ttft_ms: float | None
    mean_duration_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "requests": self.requests, "errors": self.errors,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "mean_ttft_ms": None if self.mean_ttft_ms is None else round(self.mean_ttft_ms, 1),
                "mean_duration_ms": round(self.mean_duration_ms, 1)}


UsageBy = Literal["key", "model", "day", "ring"]
_BY_COLUMN: Mapping[str, str] = {"key": "key", "model": "model", "day": "day", "ring": "ring"}
_RAW_AS_DAILY = ("SELECT date(at, 'unixepoch') AS day, key, model, ring, 1 AS requests, status >= 400 AS errors, "
                 "prompt_tokens, completion_tokens, coalesce(ttft_ms, 0) AS ttft_ms_sum, ttft_ms IS NOT NULL "
                 "AS ttft_count, duration_ms AS duration_ms_sum FROM usage")

_CACHE_LOCK = threading.Lock()
_OPEN: dict[tuple[int, str], StateDB] = {}


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class StateDB:
    """One state dir's database (see the module docstring). :meth:`for_dir` shares one per process."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / DB_FILE
        self._lock = threading.RLock()
        self._depth = 0
        self._conn = self._connect()
        try:
            self._migrate()
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def for_dir(cls, state_dir: str | os.PathLike[str]) -> StateDB:
        """The process's open database of ``state_dir`` (opened, checked and migrated on first use)."""
        key = (os.getpid(), os.path.abspath(state_dir))  # a forked child opens its own connection
        with _CACHE_LOCK:
            db = _OPEN.get(key)
            if db is None:
                db = _OPEN[key] = cls(state_dir)
            return db

    @classmethod
    def forget(cls, state_dir: str | os.PathLike[str]) -> None:
        """Close and drop the shared database of ``state_dir`` (tests that damage or replace the file)."""
        with _CACHE_LOCK:
            db = _OPEN.pop((os.getpid(), os.path.abspath(state_dir)), None)
        if db is not None:
            db.close()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- opening -----------------------------------------------------------------------------------

    def _damaged(self, detail: object) -> StateDBError:
        return StateDBError(f"the fleet's state database {self.path} is damaged ({detail}); it was left as it is. "
                            "Stop the service and restore the file (with its -wal file) from a backup; moving it "
                            "aside starts an empty fleet (agents approved, tokens and keys issued again)")

    def _connect(self) -> sqlite3.Connection:
        try:
            self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self.path.exists():  # created 0600: it holds key hashes and the fleet's shape
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                   check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise StateDBError(f"cannot open the fleet's state database {self.path} ({exc}); check the state "
                               "directory's permissions and free disk space") from exc
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise self._damaged(f"integrity check: {check[0] if check else 'no answer'}")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise self._damaged(exc) from exc
        except StateDBError:
            conn.close()
            raise
        return conn

    def _migrate(self) -> None:
        with self.transaction():
            self._conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise StateDBError(f"the fleet's state database {self.path} is schema version {version}; this "
                                   f"Deskfleet reads up to {SCHEMA_VERSION}: run the newer Deskfleet that wrote it")
            for step in MIGRATIONS[version:]:
                for statement in filter(str.strip, step.split(";")):
                    self._conn.execute(statement)
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            imported = self._conn.execute("SELECT 1 FROM meta WHERE key = 'legacy_json'").fetchone()
            if not imported:
                moved = legacy.import_legacy(self)  # one-time: the JSON files of older versions
                self._conn.execute("INSERT INTO meta VALUES ('legacy_json', ?)", (_dumps(moved),))
        if not imported:
            legacy.back_up_legacy(self.state_dir)

    @property
    def schema_version(self) -> int:
        row = self._one("SELECT value FROM meta WHERE key = 'schema_version'")
        return int(row[0]) if row else 0

    # -- transactions ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Everything inside commits together or not at all (nested calls join the outer one). Taken
        with BEGIN IMMEDIATE: a read-modify-write (a token's last use) never races another process."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._error("start a change", exc) from exc
            self._depth = 1
            try:
                yield
            except BaseException:
                self._depth = 0
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                raise
            self._depth = 0
            try:
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                raise self._error("commit a change", exc) from exc

    def _error(self, doing: str, exc: sqlite3.Error) -> StateDBError:
        if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
            return self._damaged(exc)
        return StateDBError(f"cannot {doing} in the fleet's state database {self.path} ({exc}); check free disk "
                            "space and the state directory's permissions, or whether another process holds it")

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            try:
                return self._conn.execute(sql, args)
            except sqlite3.Error as exc:
                raise self._error("read or write", exc) from exc

    def _write(self, sql: str, args: tuple[Any, ...] = ()) -> int:
        """One statement in its own transaction (or the caller's); the rows it changed."""
        with self.transaction():
            return self._run(sql, args).rowcount

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise self._error("read", exc) from exc

    def _json(self, text: str) -> Any:
        try:
            return json.loads(text)
        except (TypeError, ValueError) as exc:
            raise self._damaged(f"a stored document does not parse: {exc}") from exc

    def _one(self, sql: str, args: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        rows = self._all(sql, args)
        return rows[0] if rows else None

    # -- settings ------------------------------------------------------------------------------

    def setting(self, name: str) -> Any:
        row = self._one("SELECT value FROM settings WHERE name = ?", (name,))
        return None if row is None else self._json(row[0])

    def set_setting(self, name: str, value: Any) -> None:
        self._write("INSERT OR REPLACE INTO settings VALUES (?, ?)", (name, _dumps(value)))

    # -- approved agents -------------------------------------------------------------------------

    def approvals(self) -> list[dict[str, Any]]:
        cols = ("node_id", "name", "address", "control_port", "fleet_id", "approved_at")
        return [dict(zip(cols, r, strict=True)) for r in self._all(f"SELECT {', '.join(cols)} FROM approvals")]

    def put_approval(self, node_id: str, name: str, address: str, control_port: int, fleet_id: str,
                     approved_at: str) -> None:
        self._write("INSERT OR REPLACE INTO approvals VALUES (?, ?, ?, ?, ?, ?)",
                    (node_id, name, address, control_port, fleet_id, approved_at))

    def delete_approval(self, node_id: str) -> None:
        self._write("DELETE FROM approvals WHERE node_id = ?", (node_id,))

    # -- agents' tags ----------------------------------------------------------------------------

    def agent_tags(self) -> dict[str, tuple[list[str], list[str] | None]]:
        """node id -> (reported tags, the admin's tags or None)."""
        return {n: (self._json(r), None if a is None else self._json(a))
                for n, r, a in self._all("SELECT node_id, reported, admin FROM agent_tags")}

    def put_agent_tags(self, node_id: str, reported: list[str], admin: list[str] | None) -> None:
        if not reported and admin is None:
            self._write("DELETE FROM agent_tags WHERE node_id = ?", (node_id,))
            return
        self._write("INSERT OR REPLACE INTO agent_tags VALUES (?, ?, ?)",
                    (node_id, _dumps(reported), None if admin is None else _dumps(admin)))

    def delete_agent_tags(self, node_id: str) -> None:
        self._write("DELETE FROM agent_tags WHERE node_id = ?", (node_id,))

    # -- revoked members -------------------------------------------------------------------------

    def revocations(self) -> dict[str, dict[str, str]]:
        return {n: {"name": name, "revoked_at": at}
                for n, name, at in self._all("SELECT node_id, name, revoked_at FROM revocations")}

    def add_revocation(self, node_id: str, name: str, revoked_at: str) -> None:
        self._write("INSERT OR IGNORE INTO revocations VALUES (?, ?, ?)", (node_id, name, revoked_at))

    # -- admin certificates ------------------------------------------------------------------------

    _CERT_COLS = ("name", "not_after", "issued_at", "source", "revoked_at")

    def admin_certs(self) -> dict[str, dict[str, Any]]:
        """fingerprint -> {name, not_after, issued_at, source, revoked_at}."""
        return {r[0]: dict(zip(self._CERT_COLS, r[1:], strict=True))
                for r in self._all(f"SELECT fingerprint, {', '.join(self._CERT_COLS)} FROM admin_certs")}

    def put_admin_cert(self, fingerprint: str, record: Mapping[str, Any]) -> None:
        self._write("INSERT OR REPLACE INTO admin_certs VALUES (?, ?, ?, ?, ?, ?)",
                    (fingerprint, *(record.get(c) for c in self._CERT_COLS)))

    def delete_admin_cert(self, fingerprint: str) -> None:
        self._write("DELETE FROM admin_certs WHERE fingerprint = ?", (fingerprint,))

    # -- join tokens and their admissions --------------------------------------------------------

    _TOKEN_COLS = ("label", "issued_at", "expires_at", "uses", "used", "auto_approve", "revoked_at", "last_used_at")

    def join_tokens(self) -> dict[str, dict[str, Any]]:
        """secret hash -> the token's entry, its ``admitted`` list ({node_id, name, at}, oldest first) included."""
        tokens = {r[0]: {**dict(zip(self._TOKEN_COLS, r[1:], strict=True)), "admitted": []}
                  for r in self._all(f"SELECT secret_hash, {', '.join(self._TOKEN_COLS)} FROM join_tokens")}
        for entry in tokens.values():
            entry["auto_approve"] = bool(entry["auto_approve"])
        for h, node_id, name, at in self._all("SELECT secret_hash, node_id, name, at FROM token_admissions "
                                              "ORDER BY rowid"):
            tokens[h]["admitted"].append({"node_id": node_id, "name": name, "at": at})
        return tokens

    def join_token(self, secret_hash: str) -> dict[str, Any] | None:
        """One token's entry without its admissions (what a redeem needs)."""
        row = self._one(f"SELECT {', '.join(self._TOKEN_COLS)} FROM join_tokens WHERE secret_hash = ?",
                        (secret_hash,))
        if row is None:
            return None
        entry = dict(zip(self._TOKEN_COLS, row, strict=True))
        entry["auto_approve"] = bool(entry["auto_approve"])
        return entry

    def put_join_token(self, secret_hash: str, entry: Mapping[str, Any]) -> None:
        """Insert or update a token's own fields (its admissions are kept)."""
        values = tuple(entry[c] for c in self._TOKEN_COLS)
        sets = ", ".join(f"{c} = excluded.{c}" for c in self._TOKEN_COLS)
        self._write(f"INSERT INTO join_tokens VALUES (?, {', '.join('?' * len(values))}) "
                    f"ON CONFLICT (secret_hash) DO UPDATE SET {sets}", (secret_hash, *values))

    def delete_join_tokens(self, secret_hashes: list[str]) -> None:
        with self.transaction():
            for h in secret_hashes:
                self._run("DELETE FROM join_tokens WHERE secret_hash = ?", (h,))

    def add_admission(self, secret_hash: str, node_id: str, name: str, at: float) -> None:
        self._write("INSERT INTO token_admissions VALUES (?, ?, ?, ?)", (secret_hash, node_id, name, at))

    def admitting_tokens(self, node_id: str) -> list[str]:
        """The secret hashes of the tokens that admitted ``node_id``."""
        return [r[0] for r in self._all("SELECT DISTINCT secret_hash FROM token_admissions WHERE node_id = ?",
                                        (node_id,))]

    # -- API keys ------------------------------------------------------------------------------

    _KEY_COLS = ("name", "sha256", "issued_at", "revoked_at", "node_id")

    def _key_doc(self, row: tuple[Any, ...]) -> dict[str, Any]:
        return {**self._json(row[-1]), **dict(zip(self._KEY_COLS, row[:-1], strict=True))}

    def api_keys(self) -> list[dict[str, Any]]:
        """Every key record (live and revoked) as a document: its columns and its other fields."""
        return [self._key_doc(r) for r in self._all(f"SELECT {', '.join(self._KEY_COLS)}, fields FROM api_keys "
                                                    "ORDER BY name")]

    def api_key(self, name: str) -> dict[str, Any] | None:
        row = self._one(f"SELECT {', '.join(self._KEY_COLS)}, fields FROM api_keys WHERE name = ?", (name,))
        return None if row is None else self._key_doc(row)

    def live_api_key_by_hash(self, sha256: str) -> dict[str, Any] | None:
        row = self._one(f"SELECT {', '.join(self._KEY_COLS)}, fields FROM api_keys "
                        "WHERE sha256 = ? AND revoked_at IS NULL", (sha256,))
        return None if row is None else self._key_doc(row)

    def put_api_key(self, doc: Mapping[str, Any]) -> None:
        """Insert or replace the key ``doc["name"]``; fields beyond the columns are kept as they are
        (a key record grows fields without a schema change)."""
        extra = {k: v for k, v in doc.items() if k not in self._KEY_COLS}
        self._write("INSERT OR REPLACE INTO api_keys VALUES (?, ?, ?, ?, ?, ?)",
                    (*(doc.get(c) for c in self._KEY_COLS), _dumps(extra)))

    def prune_revoked_api_keys(self, revoked_before: str) -> list[str]:
        """Delete the keys revoked at or before ``revoked_before`` (ISO 8601 UTC); their names."""
        with self.transaction():
            names = [r[0] for r in self._run("SELECT name FROM api_keys WHERE revoked_at IS NOT NULL "
                                             "AND revoked_at <= ?", (revoked_before,)).fetchall()]
            self._run("DELETE FROM api_keys WHERE revoked_at IS NOT NULL AND revoked_at <= ?", (revoked_before,))
        return names

    def key_groups(self) -> dict[str, dict[str, int | None]]:
        return {n: {"day_tokens": d, "month_tokens": m}
                for n, d, m in self._all("SELECT name, day_tokens, month_tokens FROM key_groups ORDER BY name")}

    def put_key_group(self, name: str, day_tokens: int | None, month_tokens: int | None) -> None:
        if day_tokens is None and month_tokens is None:
            self._write("DELETE FROM key_groups WHERE name = ?", (name,))
        else:
            self._write("INSERT OR REPLACE INTO key_groups VALUES (?, ?, ?)", (name, day_tokens, month_tokens))

    # -- served rings and placements ---------------------------------------------------------------

    def served_rings(self) -> list[dict[str, Any]]:
        """The served rings' documents, in the order they were first put."""
        return [self._json(r[0]) for r in self._all("SELECT doc FROM served_rings ORDER BY rowid")]

    def put_served_ring(self, ring: str, doc: Mapping[str, Any]) -> None:
        self._write("INSERT INTO served_rings VALUES (?, ?) ON CONFLICT (ring) DO UPDATE SET doc = excluded.doc",
                    (ring, _dumps(doc)))

    def delete_served_ring(self, ring: str) -> None:
        self._write("DELETE FROM served_rings WHERE ring = ?", (ring,))

    def placements(self) -> list[dict[str, Any]]:
        return [self._json(r[0]) for r in self._all("SELECT doc FROM placements ORDER BY rowid")]

    def put_placement(self, placement_id: str, doc: Mapping[str, Any]) -> None:
        self._write("INSERT INTO placements VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET doc = excluded.doc",
                    (placement_id, _dumps(doc)))

    # -- usage -------------------------------------------------------------------------------------

    def record_usage(self, record: UsageRecord, periods: tuple[str, ...]) -> None:
        """One request's usage, and its tokens added to the key's (and its group's) totals of each
        of ``periods`` (a UTC day ``2026-12-07`` and month ``2026-12``)."""
        tokens = record.prompt_tokens + record.completion_tokens
        scopes = [f"key:{record.key}"] + ([f"group:{record.group}"] if record.group else [])
        with self.transaction():
            self._run("INSERT INTO usage (at, key, key_group, model, ring, prompt_tokens, completion_tokens, ttft_ms, "
                      "duration_ms, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (record.at, record.key, record.group, record.model, record.ring, record.prompt_tokens,
                       record.completion_tokens, record.ttft_ms, record.duration_ms, record.status))
            if tokens:
                for scope in scopes:
                    for period in periods:
                        self._run("INSERT INTO token_totals VALUES (?, ?, ?) ON CONFLICT (scope, period) "
                                  "DO UPDATE SET tokens = tokens + excluded.tokens", (scope, period, tokens))

    def tokens_used(self, scope: str, period: str) -> int:
        """Tokens ``scope`` (``key:NAME`` or ``group:NAME``) used in ``period`` (a UTC day or month)."""
        row = self._one("SELECT tokens FROM token_totals WHERE scope = ? AND period = ?", (scope, period))
        return int(row[0]) if row else 0

    def usage_summary(self, by: UsageBy, since: float, key: str | None = None) -> list[UsageRow]:
        """Usage since ``since`` (Unix time; the rolled-up days from its UTC day on) added up by
        ``by``, optionally of one key only."""
        column = _BY_COLUMN[by]
        where_key = " AND key = ?" if key is not None else ""
        args: tuple[Any, ...] = (since, *((key,) if key is not None else ()), since,
                                 *((key,) if key is not None else ()))
        rows = self._all(
            f"SELECT {column}, sum(requests), sum(errors), sum(prompt_tokens), sum(completion_tokens), "
            "sum(ttft_ms_sum), sum(ttft_count), sum(duration_ms_sum) FROM ("
            f"{_RAW_AS_DAILY} WHERE at >= ?{where_key} UNION ALL SELECT day, key, model, ring, requests, errors, "
            "prompt_tokens, completion_tokens, ttft_ms_sum, ttft_count, duration_ms_sum FROM usage_daily "
            f"WHERE day >= date(?, 'unixepoch'){where_key}) GROUP BY {column} ORDER BY {column}", args)
        return [UsageRow(str(v), int(n), int(e), int(p), int(c), (t / tc) if tc else None, d / n if n else 0.0)
                for v, n, e, p, c, t, tc, d in rows]

    def usage_count(self) -> tuple[int, int]:
        """(raw usage rows, rolled-up daily rows): what the retention bounds."""
        raw = self._one("SELECT count(*) FROM usage")
        daily = self._one("SELECT count(*) FROM usage_daily")
        return (raw[0] if raw else 0), (daily[0] if daily else 0)

    def roll_up_usage(self, raw_before: float, daily_before: str, totals_before: tuple[str, str]) -> int:
        """Fold the usage rows older than ``raw_before`` (Unix time, a UTC midnight) into one row per
        day, key, model and ring; drop the daily rows before ``daily_before`` (a UTC day) and the
        budget totals of days and months before ``totals_before`` (day, month). The raw rows folded."""
        with self.transaction():
            self._run("INSERT INTO usage_daily SELECT day, key, model, ring, sum(requests), sum(errors), "
                      "sum(prompt_tokens), sum(completion_tokens), sum(ttft_ms_sum), sum(ttft_count), "
                      f"sum(duration_ms_sum) FROM ({_RAW_AS_DAILY} WHERE at < ?) WHERE true "
                      "GROUP BY day, key, model, ring "
                      "ON CONFLICT (day, key, model, ring) DO UPDATE SET requests = requests + excluded.requests, "
                      "errors = errors + excluded.errors, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                      "completion_tokens = completion_tokens + excluded.completion_tokens, "
                      "ttft_ms_sum = ttft_ms_sum + excluded.ttft_ms_sum, "
                      "ttft_count = ttft_count + excluded.ttft_count, "
                      "duration_ms_sum = duration_ms_sum + excluded.duration_ms_sum", (raw_before,))
            folded = self._run("DELETE FROM usage WHERE at < ?", (raw_before,)).rowcount
            self._run("DELETE FROM usage_daily WHERE day < ?", (daily_before,))
            day, month = totals_before
            self._run("DELETE FROM token_totals WHERE (length(period) = 10 AND period < ?) "
                      "OR (length(period) = 7 AND period < ?)", (day, month))
        return folded
