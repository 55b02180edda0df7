"""The exports the console has made: one directory each under ``<state dir>/exports/``, described
by its manifest. Reading them is pure file I/O (no torch, no OpenVINO), so the background export
process and the console share it.

An export is identified for reuse by :class:`ExportKey`: the model's fingerprint, how the weights
were compressed and where the layers were cut. Two requests with the same key would produce the
same shards, so the second one reuses the first's directory.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ManifestError
from engine.shards.manifest import MANIFEST_NAME, Manifest, load_manifest

log = logging.getLogger(__name__)

EXPORTS_SUBDIR = "exports"


@dataclass(frozen=True)
class ExportSpec:
    """How to export, as the console offers it: the subset of ``export.exporter.ExportOptions``
    that a stateful (CPU/GPU) fleet uses. Kept here so the console need not import torch to ask."""

    weights: str = "int4"
    group_size: int = 64
    symmetric: bool = True
    kv_cache_precision: str = "f16"

    def options_kwargs(self) -> dict[str, object]:
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


def scan_exports(exports_dir: Path) -> list[ExportInfo]:
    """Every finished export under ``exports_dir``, oldest first. Hidden directories are the
    exporter's temporary ``.name.partial-PID`` ones; a directory without a readable manifest is
    skipped with a warning (it is not ours, or it was damaged by hand)."""
    if not exports_dir.is_dir():
        return []
    found = []
    for child in sorted(exports_dir.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        if not (child / MANIFEST_NAME).is_file():
            log.warning("ignoring %s: it has no %s", child, MANIFEST_NAME)
            continue
        try:
            found.append(ExportInfo.read(child))
        except (ManifestError, OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", child, exc)
    return sorted(found, key=lambda e: (e.created, e.export_id))


def find_export(exports_dir: Path, key: ExportKey) -> ExportInfo | None:
    """An existing export with exactly this key, if there is one."""
    return next((e for e in scan_exports(exports_dir) if e.key == key), None)


def partial_dir(out_dir: Path, pid: int) -> Path:
    """Where ``export.exporter`` writes ``out_dir`` while process ``pid`` exports it."""
    return out_dir.parent / f".{out_dir.name}.partial-{pid}"
