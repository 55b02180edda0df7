"""The exports as the admin API shows them, and what an export job reports: the library's
entries (:class:`ExportInfo`, identified for reuse by :class:`ExportKey`), the options an admin
chooses (:class:`ExportSpec`) and a job's events. Values only: the fleet service keeps the
library (:mod:`console.fleet.export_catalog`) and runs the jobs (:mod:`console.fleet.export_job`);
the console's views read these.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from engine.shards.manifest import Manifest, load_manifest

EXPORTS_SUBDIR = "exports"


class ExportOptionsKwargs(TypedDict):
    """What an ExportSpec sets of ``export.exporter.ExportOptions`` (keyword arguments)."""

    weights: str
    group_size: int
    symmetric: bool
    kv_cache_precision: str


@dataclass(frozen=True)
class ExportSpec:
    """How to export, as the console offers it: the subset of ``export.exporter.ExportOptions``
    that a stateful (CPU/GPU) fleet uses. Kept here so the console need not import torch to ask."""

    weights: str = "int4"
    group_size: int = 64
    symmetric: bool = True
    kv_cache_precision: str = "f16"

    def options_kwargs(self) -> ExportOptionsKwargs:
        return {"weights": self.weights, "group_size": self.group_size, "symmetric": self.symmetric,
                "kv_cache_precision": self.kv_cache_precision}


@dataclass(frozen=True)
class ExportKey:
    """What makes two exports interchangeable. ``group_size``/``symmetric`` only matter for int4."""

    fingerprint: str
    weights: str
    split: tuple[int, ...]
    kv_cache_precision: str
    group_size: int | None = None
    symmetric: bool = True
    target: str = "stateful"

    @classmethod
    def of_request(cls, fingerprint: str, split: Sequence[int], spec: ExportSpec) -> ExportKey:
        int4 = spec.weights == "int4"
        return cls(fingerprint, spec.weights, tuple(split), spec.kv_cache_precision,
                   spec.group_size if int4 else None, spec.symmetric if int4 else True)

    @classmethod
    def of_manifest(cls, manifest: Manifest) -> ExportKey:
        int4 = manifest.weights.format == "int4"
        return cls(manifest.model.fingerprint, manifest.weights.format, manifest.splits,
                   manifest.stages[0].kv_cache_precision, manifest.weights.group_size if int4 else None,
                   manifest.weights.symmetric if int4 else True, manifest.target)

    def export_id(self, model_name: str) -> str:
        """A stable directory name: readable prefix, then a hash of the whole key."""
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:10]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-._")[:60] or "model"
        return f"{slug}-{self.weights}-{len(self.split) + 1}x-{digest}"


@dataclass(frozen=True)
class ExportInfo:
    """One export in the library, as the console lists it."""

    export_id: str
    path: Path
    name: str
    fingerprint: str
    weights: str
    stages: int
    layers: tuple[tuple[int, int], ...]  # (first, last) per stage, inclusive
    size_bytes: int
    created: str
    key: ExportKey

    @property
    def split(self) -> tuple[int, ...]:
        return self.key.split

    @classmethod
    def read(cls, directory: Path) -> ExportInfo:
        """The export in ``directory``; ManifestError if it has no readable manifest."""
        manifest = load_manifest(directory)
        size = sum(f.size for s in manifest.stages for f in s.files) + sum(f.size for f in manifest.tokenizer_files)
        return cls(export_id=directory.name, path=directory, name=manifest.model.name,
                   fingerprint=manifest.model.fingerprint, weights=manifest.weights.format,
                   stages=len(manifest.stages), layers=tuple((s.first_layer, s.last_layer) for s in manifest.stages),
                   size_bytes=size, created=manifest.created, key=ExportKey.of_manifest(manifest))


# -- events (what on_event receives) ---------------------------------------------------------------


@dataclass(frozen=True)
class ExportProgress:
    """``step`` of ``stage`` began (stage None: preparing); ``fraction`` of the whole job is done."""

    stage: int | None
    step: str
    fraction: float


@dataclass(frozen=True)
class ExportFinished:
    export: ExportInfo
    reused: bool  # an identical export existed; nothing was exported
    seconds: float


@dataclass(frozen=True)
class ExportFailed:
    kind: str  # the exporter's exception class, e.g. "ExportError"
    message: str


@dataclass(frozen=True)
class ExportCancelled:
    pass


ExportEvent = ExportProgress | ExportFinished | ExportFailed | ExportCancelled
