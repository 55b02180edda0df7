"""The base of the fleet service's errors, which the admin API's client raises too (the service's
own hierarchy: :mod:`console.fleet.errors`)."""

from __future__ import annotations

from engine.errors import DeskfleetError


class ConsoleError(DeskfleetError):
    """Base of every error the console's Qt-free services raise on purpose."""
