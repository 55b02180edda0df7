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


STATEFUL_RETIRED = ("the stateful runtime was retired; paged serves CPU/GPU, static the NPU (the export's target "
                    "picks one): drop the stateful runtime option (--runtime stateful, runtime=\"stateful\")")


class StatefulRuntimeRetiredError(DeskfleetError):
    """Something asked for the stateful serving runtime, which was retired: the message says which serves instead."""

    def __init__(self, message: str = STATEFUL_RETIRED):
        super().__init__(message)


class MissingExtraError(DeskfleetError):
    """A command needs an optional dependency group (e.g. ``deskfleet[export]``) that is not installed."""


@dataclass(frozen=True)
class Exclusion:
    """An agent left out of the placement, and why ("not approved", "paused", "on battery",
    "no device profile"). Carried by `PlacementInfeasible` and by `engine.placement.types.Plan`."""

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


# -- trust: the fleet CA, join tokens, credentials ------------------------------------------------

class StateDBError(DeskfleetError):
    """The fleet's state database cannot be opened, read or written: damaged (not a database, a failed
    integrity check, a stored document that does not parse), written by a newer Deskfleet,
    unreadable, or the disk refused a write; or a state dir's JSON files from before it do not
    parse. What could not be read is left as it is, never treated as empty; the message says what
    to do (engine.state.db)."""


class TrustError(DeskfleetError):
    """Base of the trust layer's errors (fleet CA, join tokens, credentials, enrollment)."""


class CredentialsError(TrustError):
    """Raised when a certificate, key or CA is unreadable, when a key does not match its
    certificate, or when a certificate was not signed by the fleet CA it is stored with."""


class CertificateRequestError(TrustError):
    """Raised by the fleet CA when it refuses to sign a request: unreadable, its signature does not
    verify, or its key is of an unsupported type or size."""


class JoinTokenError(TrustError):
    """Raised by ``parse_token`` when the text is not a join token: mistyped, cut short, or a
    token from another product. Nothing has been sent anywhere when this is raised."""


class TokenBookError(TrustError):
    """Raised when the console's join-token book cannot be read (corrupt) or written."""


class TokenPolicyError(TrustError):
    """Raised by ``TokenBook.issue`` for a token it will not issue: zero uses, a non-positive
    ttl, an auto-approving token without an expiry (one that would admit and approve PCs
    forever), or a label that is too long; and by ``TokenBook.revoke`` for an unknown token id."""


class WrongFleetError(TrustError):
    """Raised on an agent when the console's CA does not match the fingerprint its join token
    carries: the address points at another fleet's console, or someone is in between."""


class EnrollmentError(TrustError):
    """Raised on an agent when joining fails for another reason than a refused token: the console
    is unreachable, its TLS certificate does not verify, or its answer is not understood."""


class EnrollmentTimeout(EnrollmentError):
    """Raised on an agent when the console did not answer a join step within the timeout."""


class KeyStoreError(TrustError):
    """Raised when the OS keyring (or the file keyring standing in for it) refuses a read or a
    write, or holds credentials that cannot be decoded."""


# Why a join token was refused -> what the person holding it should do. The reason is the stable
# part (logged, sent over the wire, tested); the text is for people.
JOIN_REFUSALS: dict[str, str] = {
    "malformed": "the join token is not well-formed; copy it again from the console",
    "unknown": "the console does not know this join token (revoked, or issued by another console); "
               "ask the admin for a new token",
    "expired": "the join token has expired; ask the admin for a new token",
    "used": "the join token was already used as often as it may be (a token admits as many PCs "
            "as the admin issued it for, one by default); ask the admin for a new token",
    "revoked": "the admin revoked this join token; ask the admin for a new token",
    "other_fleet": "the join token was issued for another fleet's CA; "
                   "check the console address or ask the admin for a token from this console",
}


class JoinRefused(TrustError):
    """Raised when the console refuses a join token: ``reason`` is one of ``JOIN_REFUSALS``.

    Raised by ``TokenBook.redeem`` on the console, and again on the agent from the console's
    403 answer, so both sides name the same reason.
    """

    def __init__(self, reason: str, detail: str = "", *, token_id: str | None = None,
                 token_label: str | None = None) -> None:
        text = JOIN_REFUSALS.get(reason, f"the console refused the join ({reason})")
        super().__init__(f"{text} ({detail})" if detail else text)
        self.reason = reason
        self.token_id = token_id  # set when the book knows the token (revoked, used, expired): a leak to audit
        self.token_label = token_label


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


class TagError(DeskfleetError):
    """Raised by ``engine.control.tags.parse_tags`` for an agent tag that is not one (empty, too
    long, a character outside ``a-z 0-9 - _ . : =``), too many tags, or tags not given as a list:
    in the agent's settings, an admin's request, or a placement's include/exclude tags."""
