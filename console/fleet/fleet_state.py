"""The fleet service's handle on its state database (:mod:`engine.state.db`), its errors as
:class:`~console.fleet.errors.FleetStateError`: the books of this package (approvals, tags,
revocations, admin certificates, served rings, placements) open it through :func:`fleet_db` and
change it inside :func:`state_errors`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from console.fleet.errors import FleetStateError
from engine.state.db import StateDB, StateDBError


@contextlib.contextmanager
def state_errors() -> Iterator[None]:
    """Raise a StateDBError inside as FleetStateError (same message: it names the file and what to do)."""
    try:
        yield
    except StateDBError as exc:
        raise FleetStateError(str(exc)) from exc


def fleet_db(state_dir: Path) -> StateDB:
    """The state database of ``state_dir`` (shared within the process); FleetStateError if it is damaged."""
    with state_errors():
        return StateDB.for_dir(state_dir)
