"""Who is asking, and whether they may ask now: the API's key check and per-key rate limits.

:class:`KeyCheck` turns a request's bearer token into a :class:`Caller` (the key's name and
limits), from one fixed key (``deskfleet serve --api-key-env``: the caller is named
``default``) or from the fleet's :class:`~engine.trust.key_book.KeyBook` (named keys, re-read
when the book changes, so a revoked key is refused on its next request).

:class:`RateLimiter` is pure (the clock is passed in): a sliding one-minute window per key name
of the requests it started and the tokens (prompt + completion) they used. A request is refused
while the window holds ``rpm`` requests, or ``tpm`` tokens or more; the answer says when the
oldest entry that blocks it leaves the window (``Retry-After``). Tokens are charged as they are
known: the prompt once tokenised, the answer token by token; a stream whose key is over its
``tpm`` (:meth:`RateLimiter.over_tokens`) stops there (:mod:`engine.api.share`).
"""

from __future__ import annotations

import hmac
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.generation.principal import ANONYMOUS as ANONYMOUS_PRINCIPAL
from engine.generation.principal import Principal, PrincipalId, Priority
from engine.trust.key_book import CONSOLE_KEY_NAME, KeyBook

DEFAULT_CALLER = "default"
WINDOW_S = 60.0


@dataclass(frozen=True)
class Caller:
    """The holder of the key a request carried: its name (for the audit) and its limits.

    ``scope``: whose prompts these are, for the prefix cache (one key's cached KV is never another
    key's: :attr:`~engine.generation.request.GenerationRequest.cache_scope`); a book key's is
    derived from its secret's hash, so a key issued again under the same name starts a new scope.
    ``metrics``: may read ``/metrics`` (the one fixed key, the console's key, a key issued with
    ``--metrics``). ``group``, ``day_tokens``, ``month_tokens``: the key's group and token budgets
    (:mod:`engine.api.usage`). ``member``: the fleet member a key was issued to (its tray's), whose keys share
    one :attr:`principal`; ``priority``: the key's class in a ring's fair share."""

    name: str
    rpm: int | None = None
    tpm: int | None = None
    scope: str = ""
    metrics: bool = False
    group: str | None = None
    day_tokens: int | None = None
    month_tokens: int | None = None
    member: str | None = None
    priority: Priority = Priority.INTERACTIVE

    @property
    def principal(self) -> Principal:
        """Whom a ring's fair share counts this caller's streams against
        (:attr:`~engine.generation.request.GenerationRequest.principal`): the member for a member's
        key, else the key (its scope); without keys, the one anonymous party."""
        if self.member is not None:
            return Principal(PrincipalId(f"member:{self.member}"), self.priority)
        if not self.scope:
            return ANONYMOUS_PRINCIPAL
        return Principal(PrincipalId(self.scope), self.priority)


ANONYMOUS = Caller("-")  # a server without keys (loopback only), or a stranger on /health


class KeyCheck:
    """A request's bearer token -> its :class:`Caller`, or None for a missing, wrong or revoked key.

    ``book`` wins over ``static``; with neither, :meth:`required` is False and every request is
    :data:`ANONYMOUS`. :meth:`set_static` replaces the fixed key (the console rotated it)."""

    def __init__(self, static: str | None = None, book: KeyBook | None = None) -> None:
        self._static = static.encode() if static else None
        self.book = book

    @property
    def required(self) -> bool:
        return self.book is not None or self._static is not None

    def set_static(self, key: str) -> None:
        if not key:
            raise ValueError("an empty API key would turn auth off; pass a key")
        self._static = key.encode()

    def identify(self, token: str) -> Caller | None:
        """Raises KeyBookError when the book cannot be read (the API refuses the request)."""
        if self.book is not None:
            key = self.book.identify(token)
            if key is not None:
                return Caller(key.name, key.rpm, key.tpm, scope=f"key:{key.sha256[:32]}",
                              metrics=key.metrics or key.name == CONSOLE_KEY_NAME, group=key.group,
                              day_tokens=key.day_tokens, month_tokens=key.month_tokens, member=key.node_id,
                              priority=Priority.parse(key.priority))
        # aiohttp hands header bytes that are not UTF-8 over as surrogates: compare them as the bytes they were
        if self._static is not None and hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._static):
            return Caller(DEFAULT_CALLER, scope=DEFAULT_CALLER, metrics=True)  # the operator's own key
        return None


@dataclass
class _Window:
    started: deque[float]  # when each request in the window started
    tokens: deque[tuple[float, int]]  # (when, how many) charged in the window
    token_sum: int = 0


class RateLimiter:
    """Per-name sliding windows of requests and tokens (see the module docstring). Only names with
    a limit get a window, and names come from the key book, so the windows are bounded by it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self._clock = clock
        self._window_s = window_s
        self._windows: dict[str, _Window] = {}

    def _window(self, name: str, now: float) -> _Window:
        w = self._windows.get(name)
        if w is None:
            w = self._windows[name] = _Window(deque(), deque())
        horizon = now - self._window_s
        while w.started and w.started[0] <= horizon:
            w.started.popleft()
        while w.tokens and w.tokens[0][0] <= horizon:
            w.token_sum -= w.tokens.popleft()[1]
        return w

    def admit(self, caller: Caller) -> float | None:
        """Start a request for ``caller``: None if admitted (and counted), else the seconds until it
        would be (> 0)."""
        if caller.rpm is None and caller.tpm is None:
            return None
        now = self._clock()
        w = self._window(caller.name, now)
        waits = []
        if caller.rpm is not None and len(w.started) >= caller.rpm:
            waits.append(w.started[len(w.started) - caller.rpm] + self._window_s - now)
        if caller.tpm is not None and w.token_sum >= caller.tpm:
            excess, i = w.token_sum - caller.tpm, 0
            while excess >= 0:  # drop entries from the oldest until the sum is under the limit
                excess -= w.tokens[i][1]
                i += 1
            waits.append(w.tokens[i - 1][0] + self._window_s - now)
        if waits:
            return max(max(waits), 1e-3)
        w.started.append(now)
        return None

    def over_tokens(self, caller: Caller) -> bool:
        """Whether ``caller`` has used its ``tpm`` tokens in the window (False without a token limit)."""
        if caller.tpm is None:
            return False
        return self._window(caller.name, self._clock()).token_sum >= caller.tpm

    def charge(self, caller: Caller, tokens: int) -> None:
        """Count ``tokens`` used by ``caller`` now (only for a caller with a token limit)."""
        if caller.tpm is None or tokens <= 0:
            return
        now = self._clock()
        w = self._window(caller.name, now)
        w.tokens.append((now, tokens))
        w.token_sum += tokens


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up, at least 1 (``Retry-After`` takes no fraction)."""
    return str(max(1, math.ceil(seconds)))
