"""The engine's exception hierarchy. Every message says what happened and what to do."""

from dataclasses import dataclass


class DeskfleetError(Exception):
    """Base of every error Deskfleet raises on purpose; the CLI prints these without a traceback."""


class ManifestError(DeskfleetError):
    """A shard directory or its manifest.json is missing, unreadable or of an unknown format."""


class ShardIntegrityError(ManifestError):
    """A shard file is missing, or its size or sha256 differs from what the manifest records."""


class ShardCompileError(DeskfleetError):
    """OpenVINO could not read or compile a verified shard (device missing, out of memory, ...)."""


class GenerationError(DeskfleetError):
    """A generation request is invalid (empty prompt, context exceeded, stages that do not chain)."""


class TokenizerError(DeskfleetError):
    """The tokenizer files are missing or the chat template cannot be rendered."""


class MissingExtraError(DeskfleetError):
    """A command needs an optional dependency group (e.g. ``deskfleet[export]``) that is not installed."""


@dataclass(frozen=True)
class Exclusion:
    """An agent left out of the placement, and why ("not approved", "paused", "on battery",
    "no device profile"). Carried by `PlacementInfeasible` and by `engine.placement.Plan`."""

    pc_id: str
    reason: str


class PlacementInputError(DeskfleetError):
    """Raised when the profiles or request handed to the solver are inconsistent or incomplete."""


class PlacementInfeasible(DeskfleetError):
    """Raised when no plan exists: no agent is available, or the model does not fit in memory.

    ``shortfall_bytes`` is the least extra usable memory that would make a plan possible (None
    when no agent was available at all); ``excluded`` lists the agents left out and why.
    """

    def __init__(self, message: str, *, shortfall_bytes: float | None = None,
                 excluded: tuple[Exclusion, ...] = ()) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes
        self.excluded = excluded


class PlacementTimeout(DeskfleetError):
    """Raised when the time limit passed before HiGHS found any plan."""


# -- discovery and inventory: what agents say about themselves ------------------------------------

class DiscoveryError(DeskfleetError):
    """Raised when an mDNS advertisement is malformed: a TXT field missing, oversized, of the
    wrong form or from an unknown TXT version, a bad port or address. Raised by
    ``Advertisement.from_service_info`` for a peer's record (the browser then ignores that peer)
    and when building an ``Advertisement`` locally, so a bad one is never published. Also raised
    when zeroconf cannot bind the interface asked for, or the instance name is already taken."""


class InventoryError(DeskfleetError):
    """Raised by ``Inventory.from_dict`` when an agent's inventory is malformed: a field
    missing, of the wrong type, negative, or a device of an unknown kind."""
