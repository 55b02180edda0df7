"""The traced NPU export of a whole model: torch and transformers (the export-npu extra).

:func:`export.exporter.export_model` imports this module only for ``--target npu`` and turns an
ImportError into the message naming the extra. A GGUF is first converted into a safetensors
checkpoint through transformers (:mod:`export.hf_conversion`), since the traced stage module
reads torch tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch  # noqa: F401 - fail on import, before anything is written, when the extra is missing
from transformers import AutoConfig

from engine.shards.manifest import StageManifest
from export.architectures import arch_for
from export.builder.stage_graph import StagePlan
from export.hf_conversion import hf_checkpoint
from export.options import ExportOptions, Progress
from export.stage_parts import CheckpointReader
from export.static_export import export_static_stage, validate_target

__all__ = ["export_npu", "validate_target"]


def export_npu(model: Path, plan: list[StagePlan], options: ExportOptions, out_dir: Path,
               progress: Progress) -> tuple[tuple[StageManifest, ...], Path]:
    """NPU shards of ``model`` into ``out_dir``; returns them and the checkpoint they came from."""
    checkpoint = hf_checkpoint(model)
    config = AutoConfig.from_pretrained(checkpoint)
    spec = arch_for(config)
    reader = CheckpointReader(checkpoint)
    stages = tuple(export_static_stage(config, spec, reader, s, options, out_dir, progress) for s in plan)
    return stages, checkpoint
