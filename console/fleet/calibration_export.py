"""The calibration export of a model, and the model's memory profile read from it.

Calibration times decode steps of stages of one and of two decoder layers on every candidate
device (`engine.shards.calibration`): the slope is placement's per-layer time, the intercept its
per-stage overhead. Such stages must be middle stages (no embedding, no head), so a model of
five or more layers is exported once with ``split=[1, 2, 4]`` (stage 1 holds layer 1, stage 2
layers 2-3), and a four-layer model twice, with ``[1, 2]`` and ``[1, 3]``. The exports use the
weight format that will be served, since that is what the timings must describe, and are built
once per model and format under the fleet service's state dir.

The same exports give placement's `ModelProfile`: the middle stages' file sizes are the bytes of
a layer's weights, stage 0 less one layer is the embedding, the last stage less its layers the
final norm and head. Each layer also holds its KV cache for the context and stream count asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from console.fleet.errors import CalibrationError
from engine.errors import ManifestError
from engine.placement.types import ModelProfile
from engine.shards.kv_precision import KV_BYTES_PER_VALUE
from engine.shards.manifest import Manifest, StageManifest, load_manifest

if TYPE_CHECKING:
    from export.options import ExportOptions

CALIBRATION_DIR = "calibration"
# (export name, split, stage indices holding 1 and 2 layers); the first plan that fits is used
_PLANS = ((5, (("main", (1, 2, 4), (1, 2)),)),
          (4, (("one", (1, 2), (1,)), ("two", (1, 3), (1,)))))


@dataclass(frozen=True)
class CalibrationPart:
    """One calibration export: published on the hub as ``export_id``; ``stages`` are timed."""

    export_id: str
    path: Path
    manifest: Manifest
    stages: tuple[int, ...]


@dataclass(frozen=True)
class CalibrationSet:
    """A model's calibration exports. ``key`` names the model and weight format: the key of
    every profile measured with these exports."""

    key: str
    fingerprint: str
    parts: tuple[CalibrationPart, ...]


def calibration_key(fingerprint: str, options: ExportOptions) -> str:
    """Model fingerprint + the weight format that changes its timings."""
    fmt = options.weights + (f"-g{options.group_size}" if options.weights == "int4" else "")
    return f"{fingerprint[:16]}-{fmt}"


def _plan_for(num_layers: int):
    for min_layers, parts in _PLANS:
        if num_layers >= min_layers:
            return parts
    raise CalibrationError(f"the model has {num_layers} decoder layer(s); calibration needs at least 4 "
                           "(middle stages of one and two layers). Place it on one PC without the solver.")


def build_calibration_set(checkpoint: Path, state_dir: Path, options: ExportOptions) -> CalibrationSet:
    """The calibration exports of ``checkpoint`` (an HF checkpoint dir, a .gguf, or a model
    directory prepared from one) in ``options``' weight format, exported now or reused from
    ``state_dir``. Blocking (no torch: the builder's CPU/GPU export): run it in a worker thread."""
    from export.exporter import export_model, read_config
    from export.sources import model_fingerprint

    checkpoint = Path(checkpoint)
    fingerprint = model_fingerprint(checkpoint)
    key = calibration_key(fingerprint, options)
    num_layers = int(read_config(checkpoint)["num_hidden_layers"])
    parts = []
    for name, split, stages in _plan_for(num_layers):
        out = Path(state_dir) / CALIBRATION_DIR / key / name
        manifest = _existing(out, fingerprint, split)
        if manifest is None:
            report = export_model(checkpoint, out, split=list(split), fingerprint=fingerprint,
                                  options=dataclasses.replace(options, force=True, target="stateful"))
            manifest = report.manifest
        export_id = re.sub(r"[^A-Za-z0-9._-]", "-", f"calib-{key}-{name}")
        parts.append(CalibrationPart(export_id, out, manifest, stages))
    return CalibrationSet(key, fingerprint, tuple(parts))


async def async_build_calibration_set(checkpoint: Path, state_dir: Path,
                                      options: ExportOptions) -> CalibrationSet:
    return await asyncio.to_thread(build_calibration_set, checkpoint, state_dir, options)


def _existing(out: Path, fingerprint: str, split: tuple[int, ...]) -> Manifest | None:
    """The manifest of a complete earlier export of this model and split, else None."""
    try:
        manifest = load_manifest(out)
    except ManifestError:
        return None
    if manifest.model.fingerprint != fingerprint or manifest.splits != split:
        return None
    if not all((out / f.path).is_file() and (out / f.path).stat().st_size == f.size
               for s in manifest.stages for f in s.files):
        return None
    return manifest


def _stage_bytes(stage: StageManifest) -> int:
    return sum(f.size for f in stage.files)


def model_profile(calibration: CalibrationSet, *, context: int, streams: int = 1,
                  kv_precision: str = "f16") -> ModelProfile:
    """Placement's memory profile: per layer, weights (from the middle stages' files) plus the KV
    cache of ``streams`` streams at ``context`` tokens; the embedding and head bytes from the
    first and last stages less their layers."""
    stages = [s for part in calibration.parts for s in part.manifest.stages]
    info = calibration.parts[0].manifest.model
    layer_weights = layer_weight_bytes(calibration)
    first = min((s for s in stages if s.has_embedding), key=lambda s: s.num_layers)
    last = min((s for s in stages if s.has_head), key=lambda s: s.num_layers)
    kv = 2 * info.num_kv_heads * info.head_dim * KV_BYTES_PER_VALUE[kv_precision] * context * streams
    return ModelProfile(
        layer_bytes=(int(layer_weights) + kv,) * info.num_layers,
        embed_bytes=max(int(_stage_bytes(first) - first.num_layers * layer_weights), 0),
        head_bytes=max(int(_stage_bytes(last) - last.num_layers * layer_weights), 0))


def layer_weight_bytes(calibration: CalibrationSet) -> float:
    """Mean bytes of one decoder layer's weights (middle stages' files)."""
    middle = [s for part in calibration.parts for s in part.manifest.stages
              if not s.has_embedding and not s.has_head]
    return sum(map(_stage_bytes, middle)) / sum(s.num_layers for s in middle)
