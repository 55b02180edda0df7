"""The engine's exception hierarchy. Every message says what happened and what to do."""


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
