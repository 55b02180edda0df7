"""Stage 2 of a request, admit: a parsed request and its caller in, an :class:`Admitted` out.

:class:`Admission` counts the request's ``n`` streams in the key's share of the server
(:class:`~engine.api.share.StreamShares`, 429 ``key_share_exceeded``: before the prompt is
tokenised), names the key as the owner of its grammar compiles, and hands on the key's cache scope
and a watch on the key (:func:`~engine.api.share.key_watch`) for the generate stage
(:mod:`engine.api.generate`), which charges tokens to the key as they come.

The share is given back when the answer ends, however it ends. What needs only the caller was
checked at the door, before the body was read (:mod:`engine.api.door`: the key, its rate limit and
a slot of the server); the stage before this one is :mod:`engine.api.openai_schema` (parse).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from engine.api.api_error import ApiError
from engine.api.keys import Caller, KeyCheck
from engine.api.openai_schema import CompletionParams
from engine.api.share import KeyWatch, StreamShares, key_watch
from engine.generation.grammar_pool import COMPILE_OWNER


@dataclass(frozen=True)
class Admitted:
    """A request let in: who sent it (its key's limits and cache scope) and the watch on its key
    (None: a server without keys)."""

    caller: Caller
    watch: KeyWatch | None = None


class Admission:
    """The checks of a parsed request: its streams within the key's share (where keys are required)."""

    def __init__(self, keys: KeyCheck, shares: StreamShares) -> None:
        self.keys = keys
        self.shares = shares

    @contextlib.contextmanager
    def admit(self, caller: Caller, params: CompletionParams, token: str | None) -> Iterator[Admitted]:
        """Admit ``params`` for ``caller`` (who sent the bearer ``token``); ApiError 429 past its key's share."""
        COMPILE_OWNER.set(caller.name)  # this key's share of the grammar workers (this request's task)
        streams = self._take_share(caller, params.n)
        try:
            yield Admitted(caller, key_watch(self.keys, token))
        finally:
            self.shares.give_back(caller.name, streams)

    def _take_share(self, caller: Caller, streams: int) -> int:
        """Count ``streams`` in the caller's share (where keys are required); ApiError 429 past it."""
        if not self.keys.required:
            return 0
        refused = self.shares.take(caller.name, streams)
        if refused is not None:
            raise ApiError(429, refused, "key_share_exceeded")
        return streams
