"""A model in the fleet service's library, as the admin API lists it (the library itself:
:mod:`console.fleet.models`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ModelKind = Literal["default", "hf", "gguf"]


@dataclass(frozen=True)
class ModelEntry:
    """A model the admin can export. ``path`` is None for the embedded default; ``available`` is
    False when the default's package is not installed or an added path has since vanished."""

    name: str
    kind: ModelKind
    path: Path | None
    available: bool

    @property
    def spec(self) -> str | None:
        """What ``export.sources.resolve_model`` takes for this model."""
        return None if self.path is None else str(self.path)
