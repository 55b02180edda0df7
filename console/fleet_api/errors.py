"""The base of the fleet service's errors, which the admin API's client raises too (the service's
own hierarchy: :mod:`console.fleet.errors`)."""

from __future__ import annotations

from engine.errors import DeskfleetError


class FleetServiceError(DeskfleetError):
    """Base of every error the fleet service (and its admin API's client) raises on purpose."""
