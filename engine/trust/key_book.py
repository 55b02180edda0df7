"""The fleet's API keys: named, optionally rate-limited and budgeted, revocable, kept as hashes.

A key is ``sk-deskfleet-<32 url-safe characters>`` (192 random bits). Its secret is shown once,
when it is issued; the book (the ``api_keys`` table of the state database, :mod:`engine.state.db`)
keeps only its sha256, its name (``alice``, ``wiki-bot``; the console's own is ``console``, an
agent's tray ``tray-<pc>-<node id prefix>``), whom it is for (a person or an application, and an
optional group), its limits and budgets and when it was issued or revoked. A random 192-bit
secret needs no slow hash: nobody can guess one from its sha256.

The book is shared by processes on the same state directory: the running API (which looks a key
up on every request, so a revocation takes effect on the next one) and ``deskfleet keys`` or the
fleet service's admin API (which change it), each change one transaction. A database that cannot
be read raises :class:`KeyBookError` (every key refused), never an empty book.

A revoked key's record is kept :data:`KEEP_REVOKED_DAYS` (who held what, for the usage and the
audit), then pruned (:meth:`KeyBook.prune_revoked`): a fleet whose PCs come and go would
otherwise keep one record per removed tray for ever (issue 29, L11).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engine.errors import TrustError
from engine.state.db import StateDB, StateDBError

KEY_PREFIX = "sk-deskfleet-"
KEEP_REVOKED_DAYS = 90  # how long a revoked key's record stays (L11), then it is pruned
HOLDER_KINDS = ("person", "application")
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


def _check_text(what: str, value: str | None, limit: int = 80) -> str | None:
    if value is None:
        return None
    value = " ".join(str(value).split())
    if not value or len(value) > limit or not value.isprintable():
        raise ValueError(f"{what} must be 1-{limit} printable characters, or unset; got {value!r}")
    return value


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class ApiKey:
    """One key's record. ``rpm``/``tpm``: requests and tokens (prompt + completion) per minute,
    None for no limit. ``node_id``: the fleet member the key was issued to (an agent's tray), so
    removing that member revokes it. ``metrics``: the key may read the API's ``/metrics`` (a
    monitoring system's; the console's own key may too), which no other key may. ``holder``:
    the person or application the key is for (``holder_kind``), ``group`` an optional group
    (budgets per group, usage by group); ``day_tokens``/``month_tokens``: the key's token budget
    per UTC day and month (None: none); ``priority``: its class in a ring's fair share
    (``interactive``, chat, or ``batch``: served after interactive keys when both wait, with a smaller
    share, never starved). New fields are added with a default: the book keeps
    every field without a schema change."""

    name: str
    sha256: str = field(repr=False)
    issued_at: str
    rpm: int | None = None
    tpm: int | None = None
    node_id: str | None = None
    revoked_at: str | None = None
    metrics: bool = False
    holder: str | None = None
    holder_kind: str = "person"
    group: str | None = None
    day_tokens: int | None = None
    month_tokens: int | None = None
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
        """Parse one stored record; ValueError/TypeError/KeyError when it is damaged. Fields this
        version does not know (a newer one wrote them) are left out."""
        if not isinstance(doc, dict):
            raise TypeError("a key record must be an object")
        known = {f.name for f in fields(cls)}
        key = cls(**{k: v for k, v in doc.items() if k in known})
        check_name(key.name)
        for what in ("rpm", "tpm", "day_tokens", "month_tokens"):
            _check_limit(what, getattr(key, what))
        if key.holder_kind not in HOLDER_KINDS:
            raise ValueError(f"key {key.name!r}: holder_kind must be one of {HOLDER_KINDS}")
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


class KeyBook:
    """The API keys of one state directory (see the module docstring), in its state database."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)

    @property
    def db(self) -> StateDB:
        """The state database (opened on first use, so a damaged one refuses keys, not the import)."""
        with _book_errors():
            return StateDB.for_dir(self.state_dir)

    @property
    def path(self) -> Path:
        return self.db.path

    # -- reading ------------------------------------------------------------------------------

    def keys(self) -> tuple[ApiKey, ...]:
        """Every key, live and revoked, by name."""
        with _book_errors():
            return tuple(_parse(doc) for doc in self.db.api_keys())

    def get(self, name: str) -> ApiKey | None:
        with _book_errors():
            doc = self.db.api_key(name)
        return None if doc is None else _parse(doc)

    def identify(self, secret: str) -> ApiKey | None:
        """The live key whose secret is ``secret``, or None: looked up in the database on each call,
        so a revocation by another process counts at once. KeyBookError when it cannot be read."""
        hashed = digest(secret)
        with _book_errors():
            doc = self.db.live_api_key_by_hash(hashed)
        found = None if doc is None else _parse(doc)
        # the index matched a hash; compare_digest keeps the final check constant-time
        return found if found is not None and hmac.compare_digest(found.sha256, hashed) else None

    def groups(self) -> dict[str, dict[str, int | None]]:
        """Group name -> its token budgets per day and month (groups with a budget only)."""
        with _book_errors():
            return self.db.key_groups()

    # -- changing -----------------------------------------------------------------------------

    def issue(self, name: str, *, rpm: int | None = None, tpm: int | None = None, node_id: str | None = None,
              replace_live: bool = False, metrics: bool = False, **more: Any) -> IssuedKey:
        """A new key named ``name``; its secret is returned once and kept nowhere. A revoked key
        of that name is replaced; a live one only with ``replace_live`` (the old secret stops
        working at once), else KeyNameError. ``more``: the record's other fields (holder,
        holder_kind, group, day_tokens, month_tokens)."""
        return self._put(name, new_secret(), rpm=rpm, tpm=tpm, node_id=node_id, replace_live=replace_live,
                         metrics=metrics, **more)

    def adopt(self, name: str, secret: str, *, node_id: str | None = None) -> ApiKey:
        """Record an existing secret under ``name`` (the console's key, kept in its keyring from
        before the book existed); a no-op if that live key already has this secret."""
        current = self.get(check_name(name))
        if current is not None and current.live and hmac.compare_digest(current.sha256, digest(secret)):
            return current
        return self._put(name, secret, rpm=None, tpm=None, node_id=node_id, replace_live=True).key

    def _put(self, name: str, secret: str, *, rpm: int | None, tpm: int | None, node_id: str | None,
             replace_live: bool, metrics: bool = False, **more: Any) -> IssuedKey:
        check_name(name)
        record = _checked(ApiKey(name, digest(secret), _now(), rpm, tpm, node_id, metrics=bool(metrics), **more))
        with _book_errors(), self.db.transaction():
            old = self.get(name)
            if old is not None and old.live and not replace_live:
                raise KeyNameError(f"a live key named {name!r} exists (issued {old.issued_at}); revoke it first, "
                                   "or choose another name")
            self.db.put_api_key(asdict(record))
        return IssuedKey(record, secret)

    def update(self, name: str, **changes: Any) -> ApiKey:
        """Change the live key ``name``'s limits, budgets, holder or group (its secret stays)."""
        with _book_errors(), self.db.transaction():
            old = self.get(name)
            if old is None or not old.live:
                raise KeyNameError(f"no live key named {name!r}")
            record = _checked(replace(old, **changes))
            self.db.put_api_key(asdict(record))
        return record

    def set_group_budget(self, group: str, *, day_tokens: int | None, month_tokens: int | None) -> None:
        """The token budgets of every key in ``group`` together (both None: no group budget)."""
        _check_text("a group", group, 64)
        with _book_errors():
            self.db.put_key_group(group, _check_limit("day_tokens", day_tokens),
                                  _check_limit("month_tokens", month_tokens))

    def revoke(self, name: str) -> ApiKey:
        """Revoke the live key ``name``: the running API refuses it from its next request on.
        KeyNameError if no live key has that name."""
        with _book_errors(), self.db.transaction():
            old = self.get(name)
            if old is None or not old.live:
                known = ", ".join(k.name for k in self.keys() if k.live) or "none"
                raise KeyNameError(f"no live key named {name!r} (live keys: {known})")
            revoked = replace(old, revoked_at=_now())
            self.db.put_api_key(asdict(revoked))
        return revoked

    def revoke_member(self, node_id: str) -> tuple[ApiKey, ...]:
        """Revoke every live key issued to the fleet member ``node_id`` (it was removed)."""
        done = []
        with _book_errors(), self.db.transaction():
            for key in self.keys():
                if key.live and key.node_id == node_id:
                    done.append(replace(key, revoked_at=_now()))
                    self.db.put_api_key(asdict(done[-1]))
        return tuple(done)

    def prune_revoked(self, *, keep_days: float = KEEP_REVOKED_DAYS,
                      now: datetime.datetime | None = None) -> tuple[str, ...]:
        """Forget the keys revoked more than ``keep_days`` ago (L11); the names forgotten."""
        now = now or datetime.datetime.now(datetime.UTC)
        cutoff = (now - datetime.timedelta(days=keep_days)).isoformat(timespec="seconds")
        with _book_errors():
            return tuple(self.db.prune_revoked_api_keys(cutoff))


def _checked(key: ApiKey) -> ApiKey:
    for what in ("rpm", "tpm", "day_tokens", "month_tokens"):
        _check_limit(what, getattr(key, what))
    if key.holder_kind not in HOLDER_KINDS:
        raise ValueError(f"a key is for a {' or an '.join(HOLDER_KINDS)}; got {key.holder_kind!r}")
    if key.priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {key.priority!r}")
    return replace(key, holder=_check_text("the holder's name", key.holder),
                   group=_check_text("a group", key.group, 64))


def _parse(doc: dict[str, Any]) -> ApiKey:
    try:
        return ApiKey.from_json(doc)
    except (ValueError, KeyError, TypeError, KeyNameError) as exc:
        raise KeyBookError(f"the API key book (the fleet's state database) holds a damaged key record ({exc}); "
                           "every key is refused until it is repaired: revoke and issue that key again, or "
                           "restore the database from a backup") from exc


@contextlib.contextmanager
def _book_errors() -> Iterator[None]:
    try:
        yield
    except StateDBError as exc:
        raise KeyBookError(f"the API key book cannot be read or written: {exc}") from exc
