"""The fleet's API keys: named, optionally rate-limited, revocable, kept as hashes.

A key is ``sk-deskfleet-<32 url-safe characters>`` (192 random bits). Its secret is shown once,
when it is issued; the book at ``<state dir>/api-keys.json`` keeps only its sha256, its name (a
person or an application: ``alice``, ``wiki-bot``; the console's own is ``console``, an agent's
tray ``tray-<pc>-<node id prefix>``), its limits and when it was issued or revoked. A random
192-bit secret needs no slow hash: nobody can guess one from its sha256.

The book is shared by processes on the same state directory: the running API (which re-reads
it when the file changes, so a revocation takes effect on the next request) and ``deskfleet
keys`` or the fleet service's admin API (which change it). Changes hold ``api-keys.lock`` while
they read, modify and atomically replace the file; a file that cannot be parsed raises
:class:`KeyBookError` (every key refused), never an empty book.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import os
import re
import secrets
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.atomic_file import write_text_atomic
from engine.errors import TrustError

KEY_PREFIX = "sk-deskfleet-"
BOOK_FILE = "api-keys.json"
LOCK_FILE = "api-keys.lock"
BOOK_FORMAT = "deskfleet-api-keys/1"
CONSOLE_KEY_NAME = "console"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}$")
MAX_LIMIT = 10**9
PRIORITIES = ("interactive", "batch")  # engine.generation.principal.Priority's values: a key's scheduling class


class KeyBookError(TrustError):
    """Raised when the key book cannot be read (corrupt, unreadable) or written; the API then
    refuses every key until it is repaired."""


class KeyNameError(TrustError):
    """Raised for a key name that is malformed, already held by a live key (issue) or unknown
    (revoke)."""


def new_secret() -> str:
    """A fresh API key: the prefix and 192 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


def digest(secret: str) -> str:
    """sha256 hex of ``secret``: what the book keeps."""
    return hashlib.sha256(secret.encode("utf-8", "replace")).hexdigest()


def check_name(name: str) -> str:
    """``name`` if it is a valid key name (1-64 of letters, digits, ``._@:-``), else KeyNameError."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise KeyNameError(f"key name {name!r} is not allowed: use 1-64 letters, digits and . _ @ : - "
                           "(starting with a letter or digit), e.g. alice or wiki-bot")
    return name


def sanitize_key_name(text: str) -> str:
    """``text`` (a PC's name) made a valid key name: runs of other characters become ``-``."""
    name = re.sub(r"[^A-Za-z0-9._@:-]+", "-", text).strip("-._@:")[:64]
    return name or "member"


def _check_limit(what: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT):
        raise ValueError(f"{what} must be a whole number from 1 to {MAX_LIMIT}, or unset for no limit; got {value!r}")
    return value


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class ApiKey:
    """One key's record. ``rpm``/``tpm``: requests and tokens (prompt + completion) per minute,
    None for no limit. ``node_id``: the fleet member the key was issued to (an agent's tray), so
    removing that member revokes it. ``metrics``: the key may read the API's ``/metrics`` (a
    monitoring system's; the console's own key may too), which no other key may. ``priority``:
    its class in a ring's fair share (``interactive``, chat, or ``batch``: served after interactive
    keys when both wait, with a smaller share, never starved)."""

    name: str
    sha256: str = field(repr=False)
    issued_at: str
    rpm: int | None = None
    tpm: int | None = None
    node_id: str | None = None
    revoked_at: str | None = None
    metrics: bool = False
    priority: str = "interactive"

    @property
    def live(self) -> bool:
        return self.revoked_at is None

    def to_json(self) -> dict:
        """The record without its hash: what ``keys list`` and the admin API show."""
        doc = asdict(self)
        del doc["sha256"]
        return doc

    @classmethod
    def from_json(cls, doc: object) -> ApiKey:
        """Parse one stored record; ValueError/TypeError/KeyError when it is damaged."""
        if not isinstance(doc, dict):
            raise TypeError("a key record must be an object")
        key = cls(name=check_name(doc["name"]), sha256=str(doc["sha256"]), issued_at=str(doc["issued_at"]),
                  rpm=_check_limit("rpm", doc.get("rpm")), tpm=_check_limit("tpm", doc.get("tpm")),
                  node_id=doc.get("node_id"), revoked_at=doc.get("revoked_at"), metrics=doc.get("metrics", False),
                  priority=doc.get("priority", "interactive"))
        if key.priority not in PRIORITIES:
            raise ValueError(f"key {key.name!r}: priority {key.priority!r} is not one of {', '.join(PRIORITIES)}")
        if not isinstance(key.metrics, bool):
            raise TypeError(f"key {key.name!r}: metrics must be true or false")
        if len(key.sha256) != 64 or not all(c in "0123456789abcdef" for c in key.sha256):
            raise ValueError(f"key {key.name!r} has no valid sha256")
        for what in ("node_id", "revoked_at"):
            if not isinstance(getattr(key, what), str | None):
                raise TypeError(f"key {key.name!r}: {what} must be a string or null")
        return key


@dataclass(frozen=True)
class IssuedKey:
    """A key just issued: its record and its secret, which nothing keeps (show it once)."""

    key: ApiKey
    secret: str = field(repr=False)


def _lock(fd: int) -> None:
    if sys.platform == "win32":  # the form type checkers narrow on
        import msvcrt  # Windows only

        msvcrt.locking(fd, msvcrt.LK_LOCK, 1)  # retries for 10 s, then OSError
    else:
        import fcntl  # POSIX only

        fcntl.flock(fd, fcntl.LOCK_EX)


class KeyBook:
    """The API keys of one state directory (see the module docstring)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / BOOK_FILE
        self._lock_path = Path(state_dir) / LOCK_FILE
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) of the file read last
        self._keys: dict[str, ApiKey] = {}  # by name, revoked ones included
        self._by_hash: dict[str, ApiKey] = {}  # live keys only

    # -- reading ------------------------------------------------------------------------------

    def keys(self) -> tuple[ApiKey, ...]:
        """Every key, live and revoked, by name."""
        self._refresh()
        return tuple(self._keys[n] for n in sorted(self._keys))

    def get(self, name: str) -> ApiKey | None:
        self._refresh()
        return self._keys.get(name)

    def identify(self, secret: str) -> ApiKey | None:
        """The live key whose secret is ``secret``, or None. Re-reads the book if the file changed
        since the last call (a stat per call), so a revocation by another process counts at once.
        Raises KeyBookError when the file is corrupt."""
        self._refresh()
        found = self._by_hash.get(digest(secret))
        # the dict lookup matched a hash; compare_digest keeps the final check constant-time
        return found if found is not None and hmac.compare_digest(found.sha256, digest(secret)) else None

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._seen, self._keys, self._by_hash = None, {}, {}
            return
        except OSError as exc:
            raise KeyBookError(f"cannot read the API key book {self.path} ({exc}); check its permissions") from exc
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            keys = self._read()
            self._keys = keys
            self._by_hash = {k.sha256: k for k in keys.values() if k.live}
            self._seen = seen

    def _read(self) -> dict[str, ApiKey]:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise KeyBookError(f"cannot read the API key book {self.path} ({exc}); check its permissions") from exc
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != BOOK_FORMAT:
                raise ValueError(f"not a {BOOK_FORMAT} document")
            keys = [ApiKey.from_json(entry) for entry in doc["keys"]]
        except (ValueError, KeyError, TypeError, KeyNameError) as exc:
            raise KeyBookError(f"the API key book {self.path} is corrupt ({exc}); every key is refused until it "
                               "is repaired: restore it from a backup, or move it aside and issue new keys") from exc
        by_name = {k.name: k for k in keys}
        if len(by_name) != len(keys):
            raise KeyBookError(f"the API key book {self.path} is corrupt (a name appears twice); restore it from "
                               "a backup, or move it aside and issue new keys")
        return by_name

    # -- changing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, ApiKey]]:
        """Hold the book's lock, yield its keys (fresh from disk) to change, then write them."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                _lock(fd)
            except OSError as exc:
                raise KeyBookError(f"cannot lock the API key book ({self._lock_path}: {exc}); another process "
                                   "holds it, try again") from exc
            keys = self._read()
            yield keys
            doc = {"format": BOOK_FORMAT, "keys": [asdict(keys[n]) for n in sorted(keys)]}
            try:
                write_text_atomic(self.path, json.dumps(doc, indent=1) + "\n", dir_mode=0o700)
            except OSError as exc:
                raise KeyBookError(f"cannot write the API key book {self.path} ({exc}); check the disk and "
                                   "its permissions") from exc
            self._seen = None  # re-read on the next lookup
        finally:
            os.close(fd)  # releases the lock

    def issue(self, name: str, *, rpm: int | None = None, tpm: int | None = None, node_id: str | None = None,
              replace_live: bool = False, metrics: bool = False, priority: str = "interactive") -> IssuedKey:
        """A new key named ``name``; its secret is returned once and kept nowhere. A revoked key
        of that name is replaced; a live one only with ``replace_live`` (the old secret stops
        working at once), else KeyNameError."""
        return self._put(name, new_secret(), rpm=rpm, tpm=tpm, node_id=node_id, replace_live=replace_live,
                         metrics=metrics, priority=priority)

    def adopt(self, name: str, secret: str, *, node_id: str | None = None) -> ApiKey:
        """Record an existing secret under ``name`` (the console's key, kept in its keyring from
        before the book existed); a no-op if that live key already has this secret."""
        current = self.get(check_name(name))
        if current is not None and current.live and hmac.compare_digest(current.sha256, digest(secret)):
            return current
        return self._put(name, secret, rpm=None, tpm=None, node_id=node_id, replace_live=True).key

    def _put(self, name: str, secret: str, *, rpm: int | None, tpm: int | None, node_id: str | None,
             replace_live: bool, metrics: bool = False, priority: str = "interactive") -> IssuedKey:
        check_name(name)
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        record = ApiKey(name, digest(secret), _now(), _check_limit("rpm", rpm), _check_limit("tpm", tpm), node_id,
                        metrics=bool(metrics), priority=priority)
        with self._changing() as keys:
            old = keys.get(name)
            if old is not None and old.live and not replace_live:
                raise KeyNameError(f"a live key named {name!r} exists (issued {old.issued_at}); revoke it first, "
                                   "or choose another name")
            keys[name] = record
        return IssuedKey(record, secret)

    def revoke(self, name: str) -> ApiKey:
        """Revoke the live key ``name``: the running API refuses it from its next request on.
        KeyNameError if no live key has that name."""
        with self._changing() as keys:
            old = keys.get(name)
            if old is None or not old.live:
                known = ", ".join(sorted(n for n, k in keys.items() if k.live)) or "none"
                raise KeyNameError(f"no live key named {name!r} (live keys: {known})")
            keys[name] = revoked = replace(old, revoked_at=_now())
        return revoked

    def revoke_member(self, node_id: str) -> tuple[ApiKey, ...]:
        """Revoke every live key issued to the fleet member ``node_id`` (it was removed)."""
        done = []
        with self._changing() as keys:
            for name, key in list(keys.items()):
                if key.live and key.node_id == node_id:
                    keys[name] = replace(key, revoked_at=_now())
                    done.append(keys[name])
        return tuple(done)
