"""Each key's share of a shared server, as pure code: how many answers it has in progress, and
whether a running answer's key still holds.

Rate limits (:mod:`engine.api.keys`) bound what a key starts per minute; they do not stop one
key from holding every slot at once (ten ``n = 8`` requests) or from running past its token
budget within one long answer. :class:`StreamShares` caps the streams (choices) one key has
running or queued: a request whose ``n`` would take it past its share is refused (429) before
it is tokenised. Tokens are charged as they are generated (:meth:`RateLimiter.charge
<engine.api.keys.RateLimiter.charge>` per token), and a stream whose key goes over its ``tpm``
stops there (:data:`BUDGET_STOP`). :class:`KeyWatch` re-checks a running answer's key every
:data:`RECHECK_S`, so revoking a key ends its answers too, not only its next request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# finish_reason and stop_reason of a stream stopped because its key ran out of tokens: "length"
# is the OpenAI value every client reads (the answer was cut short); ``stop_reason`` says why.
BUDGET_STOP = ("length", "token_budget")
RECHECK_S = 1.0  # how often a running answer's key is looked up again


class StreamShares:
    """Streams in progress per key name, each key at most ``per_key``. Names are only held while
    they have streams, so the table is bounded by the server's own admission limit."""

    def __init__(self, per_key: int) -> None:
        if per_key < 1:
            raise ValueError(f"a key's share of streams must be at least 1, got {per_key}")
        self.per_key = per_key
        self._held: dict[str, int] = {}

    def held(self, name: str) -> int:
        return self._held.get(name, 0)

    def take(self, name: str, streams: int) -> bool:
        """Count ``streams`` more for ``name``; False (nothing counted) past its share."""
        if self.held(name) + streams > self.per_key:
            return False
        self._held[name] = self.held(name) + streams
        return True

    def give_back(self, name: str, streams: int) -> None:
        left = self.held(name) - streams
        if left > 0:
            self._held[name] = left
        else:
            self._held.pop(name, None)


class KeyWatch:
    """Whether a running answer's key still holds: ``check()`` (the key looked up again) at most
    every ``every_s`` seconds, the last answer in between."""

    def __init__(self, check: Callable[[], bool], *, every_s: float = RECHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self._every_s = every_s
        self._clock = clock
        self._next = clock() + every_s
        self._valid = True

    def valid(self) -> bool:
        now = self._clock()
        if self._valid and now >= self._next:
            self._next = now + self._every_s
            self._valid = self._check()
        return self._valid
