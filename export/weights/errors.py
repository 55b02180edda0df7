"""The errors of :mod:`export.weights`, in a module of their own so that every reader (the
safetensors reader in :mod:`export.weights.checkpoint`, the GGUF one in
:mod:`export.weights.gguf_source`) raises the same class without importing another reader."""

from __future__ import annotations

from engine.errors import DeskfleetError


class CheckpointError(DeskfleetError):
    """A checkpoint cannot be read: missing or malformed files, an unknown tensor name or dtype,
    or a tensor name that appears in two files."""
