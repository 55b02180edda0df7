"""Whose request this is, for the paged scheduler's fair share (issue 29 deliverable 2, issue 33
deliverable 3): a :class:`Principal` and its :class:`Priority`.

The API names the principal of every request it admits (:mod:`engine.api.keys`: the key's scope,
the member for a key issued to a fleet member, one shared :data:`ANONYMOUS` for a server without
keys) and puts it on each of the request's choices
(:attr:`~engine.generation.request.GenerationRequest.principal`), beside the key's prefix-cache
scope. The scheduler then gives each principal with work waiting at most its share of a step's
rows and token budget, and of the ring's slots (:mod:`engine.paged.fair_share`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

PrincipalId = NewType("PrincipalId", str)


class Priority(enum.Enum):
    """A key's class: interactive chat goes before batch jobs when both wait, and weighs more in the
    shares (:data:`PRIORITY_WEIGHTS`); batch still gets its weight's share (never starved)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 first: the order classes are served in when both wait."""
        return _RANKS[self]

    @classmethod
    def parse(cls, text: str) -> Priority:
        """The class named ``text``; ValueError naming the choices otherwise."""
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"priority {text!r} is not one of {', '.join(p.value for p in cls)}") from None


_RANKS = {Priority.INTERACTIVE: 0, Priority.BATCH: 1}
PRIORITY_WEIGHTS = {Priority.INTERACTIVE: 4, Priority.BATCH: 1}  # a principal's weight in the shares


@dataclass(frozen=True)
class Principal:
    """One party sharing a ring: ``id`` names it (a key's scope, ``member:<node id>``, or
    ``anonymous``; never a secret), ``priority`` its class."""

    id: PrincipalId
    priority: Priority = Priority.INTERACTIVE

    @property
    def weight(self) -> int:
        return PRIORITY_WEIGHTS[self.priority]


ANONYMOUS = Principal(PrincipalId("anonymous"))  # every request of a server without keys: one party
