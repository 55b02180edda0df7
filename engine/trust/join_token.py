"""One-time join tokens: what the console shows and an agent types or pastes to join.

A token is ``DFJ1-<ca pin>-<secret>-<check>``: the first 32 hex digits of the fleet CA's
sha256, a 128-bit secret in base32, and 4 check characters. The pin lets an agent check the
console's CA *before* it trusts anything the console says (as kubeadm's
discovery-token-ca-cert-hash does); the check characters turn a typo into "mistyped" instead of
"unknown token" or, worse, "wrong fleet". The console keeps only the sha256 of each secret, in a
:class:`TokenBook` on disk, so a copy of the book admits nobody.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.atomic_file import write_text_atomic
from engine.errors import JoinRefused, JoinTokenError, TokenBookError

PREFIX = "DFJ1"
PIN_HEX = 32  # 128 bits of the CA fingerprint: a second-preimage search is out of reach
SECRET_BYTES = 16
SECRET_CHARS = 26  # base32 of 16 bytes, padding removed
CHECK_CHARS = 4
DEFAULT_TTL_S = 24 * 3600.0
KEEP_EXPIRED_S = 7 * 24 * 3600.0  # how long the book remembers a dead token, to say "expired" not "unknown"
BOOK_FORMAT = "deskfleet-join-tokens/1"
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


class TokenBook:
    """The console's register of issued join tokens, persisted as JSON at ``path``.

    Holds only sha256(secret), expiry and use time per token. Read on every call and written
    atomically (temp file + ``os.replace``), so a crash never leaves half a book, and a book
    that cannot be read raises TokenBookError instead of silently forgetting tokens. Meant for
    one console process; two writers at once would lose each other's updates.
    """

    def __init__(self, path: str | os.PathLike[str], ca_fingerprint: str, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._ca_fingerprint = ca_fingerprint.lower()
        self._clock = clock

    def issue(self, ttl_s: float = DEFAULT_TTL_S) -> str:
        """A new single-use token valid for ``ttl_s`` seconds; its text is shown once, never stored."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        token = JoinToken.new(self._ca_fingerprint)
        now = self._clock()
        tokens = self._load()
        tokens[token.secret_hash] = {"issued_at": now, "expires_at": now + ttl_s, "used_at": None}
        self._save(tokens, now)
        return token.text

    def redeem(self, token: str | JoinToken) -> None:
        """Use up ``token``: return if it admits a PC now, else raise JoinRefused with reason
        malformed / other_fleet / unknown / used / expired. A refused token is not consumed."""
        if not isinstance(token, JoinToken):
            try:
                token = parse_token(token)
            except JoinTokenError as exc:
                raise JoinRefused("malformed", str(exc)) from None
        if not token.pins(self._ca_fingerprint):
            raise JoinRefused("other_fleet")
        now = self._clock()
        tokens = self._load()
        entry = tokens.get(token.secret_hash)
        if entry is None:
            raise JoinRefused("unknown")
        if entry["used_at"] is not None:
            raise JoinRefused("used")
        if now >= entry["expires_at"]:
            raise JoinRefused("expired")
        entry["used_at"] = now
        self._save(tokens, now)

    def outstanding(self) -> int:
        """How many tokens could still admit a PC (for the console's display)."""
        now = self._clock()
        return sum(1 for e in self._load().values() if e["used_at"] is None and now < e["expires_at"])

    def _load(self) -> dict[str, dict]:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise TokenBookError(f"cannot read the join-token book {self.path} ({exc}); "
                                 "check its permissions") from exc
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != BOOK_FORMAT:
                raise ValueError(f"not a {BOOK_FORMAT} document")
            tokens = doc["tokens"]
            for key, entry in tokens.items():
                if len(key) != 64 or not isinstance(entry["expires_at"], int | float) \
                        or not isinstance(entry["used_at"], int | float | None):
                    raise ValueError(f"entry {key[:12]}... is damaged")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TokenBookError(f"the join-token book {self.path} is corrupt ({exc}); move it aside "
                                 "(the tokens in it stop working) and issue new tokens") from exc
        return tokens

    def _save(self, tokens: dict[str, dict], now: float) -> None:
        keep = {k: e for k, e in tokens.items() if e["expires_at"] > now - KEEP_EXPIRED_S}
        data = json.dumps({"format": BOOK_FORMAT, "tokens": keep}, indent=1, sort_keys=True)
        try:
            write_text_atomic(self.path, data)
        except OSError as exc:
            raise TokenBookError(f"cannot write the join-token book {self.path} ({exc}); "
                                 "check the disk and its permissions") from exc

