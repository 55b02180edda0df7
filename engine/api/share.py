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

from engine.api.keys import KeyCheck
from engine.trust.key_book import KeyBookError

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

    def take(self, name: str, streams: int) -> str | None:
        """Count ``streams`` more for ``name``: None, or (nothing counted) why not, past its share."""
        held = self.held(name)
        if held + streams > self.per_key:
            return (f"the key {name!r} has {held} answers in progress and asks for {streams} more; a key's share "
                    f"of this server is {self.per_key} at once. Wait for one to end, or ask the fleet's admin for "
                    "a key of your own")
        self._held[name] = held + streams
        return None

    def give_back(self, name: str, streams: int) -> None:
        left = self.held(name) - streams
        if left > 0:
            self._held[name] = left
        else:
            self._held.pop(name, None)


def key_watch(keys: KeyCheck, token: str | None) -> KeyWatch | None:
    """A running answer's ``token`` looked up again every :data:`RECHECK_S` (None: a server without keys)."""
    if not keys.required or token is None:
        return None

    def still_valid() -> bool:
        try:
            return keys.identify(token) is not None
        except KeyBookError:
            return True  # an unreadable book refuses new requests; running ones are not cut for it
    return KeyWatch(still_valid)


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
