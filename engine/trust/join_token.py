"""Join tokens: what the console shows and an agent types, pastes or finds in a file to join.

A token is ``DFJ1-<ca pin>-<secret>-<check>``: the first 32 hex digits of the fleet CA's
sha256, a 128-bit secret in base32, and 4 check characters. The pin lets an agent check the
console's CA *before* it trusts anything the console says (as kubeadm's
discovery-token-ca-cert-hash does); the check characters turn a typo into "mistyped" instead of
"unknown token" or, worse, "wrong fleet". The console keeps only the sha256 of each secret, in a
:class:`TokenBook` on disk, so a copy of the book admits nobody.

A token admits ``uses`` PCs (1 by default: single use), until it expires (``ttl_s``; ``None``:
never) or the admin revokes it by its public id (the first 10 hex digits of the secret's
sha256: naming it in a list or an audit line gives nothing away). A token marked
``auto_approve`` also approves the PCs it admits; such a token must expire. The book remembers
which PCs each token admitted (node id, name, when), for the console's list and the audit.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import JoinRefused, JoinTokenError, TokenBookError, TokenPolicyError
from engine.state.db import StateDB, StateDBError

PREFIX = "DFJ1"
PIN_HEX = 32  # 128 bits of the CA fingerprint: a second-preimage search is out of reach
SECRET_BYTES = 16
SECRET_CHARS = 26  # base32 of 16 bytes, padding removed
CHECK_CHARS = 4
DEFAULT_TTL_S = 24 * 3600.0
KEEP_EXPIRED_S = 7 * 24 * 3600.0  # how long the book remembers a dead token, to say "expired" not "unknown"
TOKEN_ID_HEX = 10
MAX_USES = 100_000
MAX_LABEL_CHARS = 80
MAX_TTL_S = 366 * 86400.0  # a token that should outlive a year is one with no expiry: say so (ttl None)
MAX_AUTO_APPROVE_TTL_S = 30 * 86400.0  # an auto-approving token is an admin's approval: a roll-out's weeks at most
_HEX = frozenset("0123456789abcdef")
_B32 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567")


def _check(body: str) -> str:
    return base64.b32encode(hashlib.sha256(body.encode("ascii")).digest()[:5]).decode("ascii")[:CHECK_CHARS]


@dataclass(frozen=True)
class JoinToken:
    """A parsed join token: the CA pin (hex) and the secret the console redeems."""

    ca_pin: str
    secret: bytes = field(repr=False)

    @classmethod
    def new(cls, ca_fingerprint: str) -> JoinToken:
        return cls(ca_fingerprint[:PIN_HEX].lower(), secrets.token_bytes(SECRET_BYTES))

    @property
    def text(self) -> str:
        """The token as people see it."""
        body = f"{PREFIX}-{self.ca_pin}-{base64.b32encode(self.secret).decode('ascii').rstrip('=')}"
        return f"{body}-{_check(body)}"

    @property
    def secret_hash(self) -> str:
        return hashlib.sha256(self.secret).hexdigest()

    def pins(self, ca_fingerprint: str) -> bool:
        """Whether this token was issued for the CA with this sha256 (hex)."""
        return hmac.compare_digest(self.ca_pin, ca_fingerprint[:PIN_HEX].lower())


def parse_token(text: str) -> JoinToken:
    """Parse a token as typed or pasted (whitespace and case do not matter).

    Raises JoinTokenError naming what is wrong, before anything is sent anywhere.
    """
    compact = "".join(str(text).split())
    parts = compact.split("-")
    if len(parts) != 4 or parts[0].upper() != PREFIX:
        raise JoinTokenError(f"this is not a Deskfleet join token: it should look like {PREFIX}-<32 hex>-"
                             f"<{SECRET_CHARS} letters/digits>-<{CHECK_CHARS} letters/digits>; "
                             "copy the whole token from the console")
    pin, secret, check = parts[1].lower(), parts[2].upper(), parts[3].upper()
    if len(pin) != PIN_HEX or not set(pin) <= _HEX:
        raise JoinTokenError(f"the join token's second part should be {PIN_HEX} hex digits (0-9, a-f); "
                             "copy the token again from the console")
    if len(secret) != SECRET_CHARS or not set(secret) <= _B32:
        raise JoinTokenError(f"the join token's third part should be {SECRET_CHARS} characters A-Z, 2-7; "
                             "copy the token again from the console")
    body = f"{PREFIX}-{pin}-{secret}"
    if not hmac.compare_digest(check, _check(body)):
        raise JoinTokenError("the join token has a typo (its last 4 characters do not match the rest); "
                             "copy it again from the console")
    try:
        raw = base64.b32decode(secret + "=" * (-len(secret) % 8))
    except binascii.Error as exc:  # unreachable after the checks above, kept as a guard
        raise JoinTokenError(f"the join token's secret does not decode ({exc})") from exc
    return JoinToken(pin, raw)


@dataclass(frozen=True)
class Admission:
    """One PC a token admitted: its node id (the sha256 of its new certificate), name and when."""

    node_id: str
    name: str
    at: float


@dataclass(frozen=True)
class Redeemed:
    """What a redeemed token was: its public id, label and whether it approves what it admits."""

    token_id: str
    label: str
    auto_approve: bool


@dataclass(frozen=True)
class TokenInfo:
    """A token as the console lists it (never its secret): ``state`` is active / used_up /
    expired / revoked; ``expires_at`` None for a token that never expires."""

    token_id: str
    label: str
    uses: int
    used: int
    issued_at: float
    expires_at: float | None
    auto_approve: bool
    revoked_at: float | None
    state: str
    admitted: tuple[Admission, ...]

    @property
    def uses_left(self) -> int:
        return max(0, self.uses - self.used) if self.state == "active" else 0

    def to_json(self, *, admitted_limit: int | None = None) -> dict:
        """The listing's shape; ``admitted_limit`` keeps only the newest that many admissions (the
        count of all is ``admitted_count`` either way)."""
        admitted = self.admitted
        if admitted_limit is not None:
            admitted = admitted[max(0, len(admitted) - admitted_limit):]
        return {"id": self.token_id, "label": self.label, "uses": self.uses, "used": self.used,
                "uses_left": self.uses_left, "issued_at": self.issued_at, "expires_at": self.expires_at,
                "auto_approve": self.auto_approve, "revoked_at": self.revoked_at, "state": self.state,
                "admitted_count": len(self.admitted),
                "admitted": [{"node_id": a.node_id, "name": a.name, "at": a.at} for a in admitted]}


@dataclass(frozen=True)
class Issued:
    """A token just issued: its text (shown once, never stored) and its listing."""

    text: str = field(repr=False)
    info: TokenInfo


def token_id_of(secret_hash: str) -> str:
    return secret_hash[:TOKEN_ID_HEX]


def _state(entry: dict, now: float) -> str:
    if entry["revoked_at"] is not None:
        return "revoked"
    if entry["used"] >= entry["uses"]:
        return "used_up"
    if entry["expires_at"] is not None and now >= entry["expires_at"]:
        return "expired"
    return "active"


def _info(key: str, entry: dict, now: float) -> TokenInfo:
    return TokenInfo(token_id_of(key), entry["label"], entry["uses"], entry["used"], entry["issued_at"],
                     entry["expires_at"], entry["auto_approve"], entry["revoked_at"], _state(entry, now),
                     tuple(Admission(a["node_id"], a["name"], a["at"]) for a in entry["admitted"]))


class TokenBook:
    """The console's register of issued join tokens, kept in the state database of ``path``'s
    directory (:mod:`engine.state.db`; ``path`` names the book, as it did when the book was a file).

    Holds only sha256(secret), uses, expiry, label and the PCs admitted per token. Every
    read-modify-write is one transaction (BEGIN IMMEDIATE): a token of N uses admits at most N PCs
    however many join at once, in this process or another; a database that cannot be read raises
    TokenBookError instead of silently forgetting tokens. A dead token is kept KEEP_EXPIRED_S.
    """

    def __init__(self, path: str | os.PathLike[str], ca_fingerprint: str, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._ca_fingerprint = ca_fingerprint.lower()
        self._clock = clock

    @property
    def db(self) -> StateDB:
        with _book_errors():
            return StateDB.for_dir(self.path.parent)

    def issue(self, ttl_s: float | None = DEFAULT_TTL_S) -> str:
        """A new single-use token valid for ``ttl_s`` seconds; its text is shown once, never stored."""
        return self.issue_token(ttl_s=ttl_s).text

    def issue_token(self, *, uses: int = 1, ttl_s: float | None = DEFAULT_TTL_S, auto_approve: bool = False,
                    label: str = "") -> Issued:
        """A new token admitting ``uses`` PCs for ``ttl_s`` seconds (None: no expiry), approving
        them on join when ``auto_approve``. TokenPolicyError for what it will not issue."""
        if isinstance(uses, bool) or not isinstance(uses, int) or not 1 <= uses <= MAX_USES:
            raise TokenPolicyError(f"a token admits 1 to {MAX_USES} PCs; got uses={uses!r}")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                                  or not 0 < ttl_s <= MAX_TTL_S):  # NaN and Infinity fail here too
            raise TokenPolicyError(f"a token's ttl_s must be a positive number of seconds up to {MAX_TTL_S:.0f} "
                                   f"(366 days), or none: no expiry; got {ttl_s!r}")
        if auto_approve and ttl_s is None:
            raise TokenPolicyError("an auto-approving token must expire: it admits and approves every PC that "
                                   "shows it; give it a ttl (e.g. 86400 s for a day's roll-out)")
        if auto_approve and ttl_s is not None and ttl_s > MAX_AUTO_APPROVE_TTL_S:
            raise TokenPolicyError(f"an auto-approving token lasts at most {MAX_AUTO_APPROVE_TTL_S:.0f} s (30 days): "
                                   f"it approves every PC that shows it; got ttl_s={ttl_s!r}. Issue a new one "
                                   "for a longer roll-out")
        label = " ".join(str(label).split())
        if len(label) > MAX_LABEL_CHARS or not label.isprintable():
            raise TokenPolicyError(f"a token's label is at most {MAX_LABEL_CHARS} printable characters")
        token = JoinToken.new(self._ca_fingerprint)
        now = self._clock()
        entry = {"label": label, "issued_at": now, "expires_at": None if ttl_s is None else now + ttl_s,
                 "uses": uses, "used": 0, "auto_approve": bool(auto_approve), "revoked_at": None,
                 "last_used_at": None}
        with _book_errors(), self.db.transaction():
            self._prune(now)
            self.db.put_join_token(token.secret_hash, entry)
        return Issued(token.text, _info(token.secret_hash, {**entry, "admitted": []}, now))

    def redeem(self, token: str | JoinToken) -> Redeemed:
        """Use ``token`` once: return what it is if it admits a PC now, else raise JoinRefused
        with reason malformed / other_fleet / unknown / revoked / used / expired. A refused
        token is not consumed."""
        if not isinstance(token, JoinToken):
            try:
                token = parse_token(token)
            except JoinTokenError as exc:
                raise JoinRefused("malformed", str(exc)) from None
        if not token.pins(self._ca_fingerprint):
            raise JoinRefused("other_fleet")
        with _book_errors(), self.db.transaction():
            now = self._clock()
            entry = self.db.join_token(token.secret_hash)
            if entry is None:
                raise JoinRefused("unknown")
            state = _state(entry, now)
            if state != "active":
                raise JoinRefused({"used_up": "used"}.get(state, state), token_id=token_id_of(token.secret_hash),
                                  token_label=entry.get("label"))
            self.db.put_join_token(token.secret_hash, {**entry, "used": entry["used"] + 1, "last_used_at": now})
        return Redeemed(token_id_of(token.secret_hash), entry["label"], entry["auto_approve"])

    def record_admission(self, token_id: str, node_id: str, name: str) -> None:
        """Remember that the token ``token_id`` admitted PC ``node_id`` (called once its certificate
        is signed). A token pruned meanwhile is logged by the caller, not an error here."""
        with _book_errors(), self.db.transaction():
            for key in self.db.join_tokens():
                if token_id_of(key) == token_id:
                    self.db.add_admission(key, node_id, name[:64], self._clock())
                    return

    def admitted_by(self, node_id: str) -> TokenInfo | None:
        """The token that admitted ``node_id`` (the newest, should it have joined twice), or None."""
        now = self._clock()
        with _book_errors():
            hashes = self.db.admitting_tokens(node_id)
            if not hashes:
                return None
            tokens = self.db.join_tokens()
        infos = [_info(h, tokens[h], now) for h in hashes if h in tokens]
        return max(infos, key=lambda info: info.issued_at, default=None)

    def revoke(self, token_id: str) -> TokenInfo:
        """Stop the token ``token_id`` admitting anyone from now on (PCs it admitted stay)."""
        with _book_errors(), self.db.transaction():
            now = self._clock()
            for key, entry in self.db.join_tokens().items():
                if token_id_of(key) == token_id:
                    if entry["revoked_at"] is None:
                        entry["revoked_at"] = now
                        self.db.put_join_token(key, entry)
                    return _info(key, entry, now)
        raise TokenPolicyError(f"no join token {token_id!r} in this console's book; list them with "
                               "'deskfleet fleet tokens list'")

    def tokens(self) -> tuple[TokenInfo, ...]:
        """Every token the book keeps, newest first."""
        now = self._clock()
        with _book_errors():
            infos = (_info(k, e, now) for k, e in self.db.join_tokens().items() if _kept(e, now))
            return tuple(sorted(infos, key=lambda t: (-t.issued_at, t.token_id)))

    def outstanding(self) -> int:
        """How many tokens could still admit a PC (for the console's display)."""
        return sum(1 for t in self.tokens() if t.state == "active")

    def _prune(self, now: float) -> None:
        """Forget the tokens dead for over KEEP_EXPIRED_S (with their admissions)."""
        dead = [k for k, e in self.db.join_tokens().items() if not _kept(e, now)]
        if dead:
            self.db.delete_join_tokens(dead)


@contextlib.contextmanager
def _book_errors() -> Iterator[None]:
    try:
        yield
    except StateDBError as exc:
        raise TokenBookError(f"the join-token book cannot be read or written: {exc}") from exc


def _kept(entry: dict, now: float) -> bool:
    """Whether the book still remembers ``entry``: a dead token (expired, revoked, used up) for
    KEEP_EXPIRED_S after it died, to say "expired" rather than "unknown" and list whom it admitted."""
    ends = [t for t in (entry["expires_at"], entry["revoked_at"]) if t is not None]
    if entry["used"] >= entry["uses"]:
        last = entry.get("last_used_at")
        ends.append(last if isinstance(last, int | float) else entry["issued_at"])
    return not ends or min(ends) > now - KEEP_EXPIRED_S
