"""The exports the fleet service has made: one directory each under ``<state dir>/exports/``, described
by its manifest. Reading them is pure file I/O (no torch, no OpenVINO), so the background export
process and the fleet service share it.

An export is identified for reuse by :class:`ExportKey`: the model's fingerprint, how the weights
were compressed and where the layers were cut. Two requests with the same key would produce the
same shards, so the second one reuses the first's directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from console.fleet_api.exports import ExportInfo, ExportKey
from engine.errors import ManifestError
from engine.shards.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)

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
