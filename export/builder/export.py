"""Export a checkpoint into stateful per-stage shards with the graph builder (no torch).

Per stage: open a :class:`StageWeights` for the stage's weight mode, build the graph op by op
(:func:`build_stage_model`), save the IR, record files and ports in the manifest. The export is
written into a temporary sibling directory and renamed into place at the end, so an error or a
crash never leaves a half-written export behind. The manifest means what the traced export's
meant: same inputs and outputs, same per-layer state names, format version 1.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import openvino as ov

from engine import __version__
from engine.errors import DeskfleetError
from engine.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ModelInfo,
    StageManifest,
    TensorSpec,
    WeightInfo,
    file_entry,
    format_version_for,
)
from export.builder.families import ModelShape, model_shape
from export.builder.stage_graph import (
    BEAM_IDX,
    StagePlan,
    build_stage_model,
    head_tensor,
    stage_tensor_names,
)
from export.compress import PRESETS, check_group_size

XML_NAME = "openvino_model.xml"
KV_PRECISIONS = ("f32", "f16", "u8")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
)
Progress = Callable[[int, str], None]
# (source, WeightMode, bin path or None) -> a StageWeights context manager
WeightsFactory = Callable[[Any, Any, Path | None], Any]


class BuildError(DeskfleetError):
    """The export request cannot be carried out (split out of range, output exists, tensor missing)."""


@dataclass(frozen=True)
class BuildReport:
    out_dir: Path
    manifest: Manifest
    seconds: float
    peak_rss_bytes: int
    baseline_rss_bytes: int
    stage_file_bytes: tuple[int, ...]


def plan_stages(num_layers: int, stages: int | None = None, split: Sequence[int] | None = None) -> list[StagePlan]:
    """Contiguous layer ranges from ``--stages N`` (as even as possible) or ``--split a,b,...``."""
    if (stages is None) == (split is None):
        raise BuildError("give exactly one of --stages N or --split A,B,...")
    if stages is not None:
        if not 1 <= stages <= num_layers:
            raise BuildError(f"--stages {stages} is out of range: this model has {num_layers} layers (1..{num_layers} stages)")
        base, extra = divmod(num_layers, stages)
        cuts, at = [], 0
        for i in range(stages - 1):
            at += base + (1 if i < extra else 0)
            cuts.append(at)
        split = cuts
    cuts = list(split or [])
    if any(not 0 < c < num_layers for c in cuts) or cuts != sorted(set(cuts)):
        raise BuildError(
            f"--split {','.join(map(str, cuts))} is out of range: cut points must be increasing layer "
            f"numbers between 1 and {num_layers - 1} (this model has {num_layers} layers)")
    bounds = [0, *cuts, num_layers]
    return [StagePlan(index=i, first_layer=bounds[i], last_layer=bounds[i + 1] - 1,
                      has_embedding=i == 0, has_head=i == len(bounds) - 2)
            for i in range(len(bounds) - 1)]


def weight_mode(options: Any):
    """The StageWeights mode of the CLI's --weights / --group-size / --asym."""
    from export.weights.stage_weights import WeightMode

    if options.weights == "int4":
        return WeightMode("int4_sym" if options.symmetric else "int4_asym", options.group_size)
    return WeightMode({"int8": "int8_asym", "fp16": "fp16", "fp32": "fp32"}[options.weights])


def _default_weights(source: Any, mode: Any, bin_path: Path | None) -> Any:
    from export.weights.stage_weights import StageWeights

    return StageWeights(source, mode, bin_path)


def validate(shape: ModelShape, options: Any) -> None:
    if options.weights not in PRESETS:
        raise BuildError(f"unknown --weights {options.weights!r}; choose one of {', '.join(PRESETS)}")
    if options.kv_cache_precision not in KV_PRECISIONS:
        raise BuildError(f"unknown KV cache precision {options.kv_cache_precision!r}; choose one of {', '.join(KV_PRECISIONS)}")
    if options.weights == "int4":
        check_group_size(options.group_size, {"hidden size": shape.hidden, "intermediate size": shape.intermediate,
                                              "attention width": shape.heads * shape.head_dim})


def _port(port: ov.Output) -> TensorSpec:
    dims = tuple(-1 if d.is_dynamic else d.get_length() for d in port.get_partial_shape())
    return TensorSpec(name=port.get_any_name(), dtype=port.get_element_type().get_type_name(), shape=dims)


def estimate_memory(shape: ModelShape, stage: StagePlan, file_bytes: int, kv_precision: str, context: int) -> int:
    """Shard files + KV at ``context`` positions + compiled-graph scratch (measured order of magnitude)."""
    per_position = 2 * len(stage.layers) * shape.kv_heads * shape.head_dim * {"f32": 4, "f16": 2, "u8": 1}[kv_precision]
    return file_bytes + per_position * context + 64 * 1024 * 1024


def export_stage(source: Any, shape: ModelShape, stage: StagePlan, options: Any, out_dir: Path,
                 progress: Progress, weights_factory: WeightsFactory = _default_weights, mode: Any = None) -> StageManifest:
    """Build and save one stage into ``out_dir/stage_{index}``."""
    available = source.names()
    missing = [n for n in stage_tensor_names(shape, stage, available) if n not in available]
    if missing:
        raise BuildError(f"checkpoint tensor {missing[0]!r} is missing; the checkpoint is incomplete")
    stage_dir = out_dir / f"stage_{stage.index}"
    stage_dir.mkdir(parents=True)
    progress(stage.index, "build")
    # Constants go to a scratch file as they are produced and are memory-mapped back, so the
    # stage is never whole in anonymous memory; closing the weights deletes it.
    scratch = out_dir / f".stage_{stage.index}.weights"
    with weights_factory(source, mode if mode is not None else weight_mode(options), scratch) as weights:
        model = build_stage_model(shape, stage, weights, head_tensor(shape, available), options.beam_idx)
        model.set_rt_info(options.kv_cache_precision, ["runtime_options", "KV_CACHE_PRECISION"])
        progress(stage.index, "save")
        ov.save_model(model, stage_dir / XML_NAME, compress_to_fp16=False)
        inputs = tuple(_port(p) for p in model.inputs)
        outputs = tuple(_port(p) for p in model.outputs)
        del model
    gc.collect()
    files = tuple(file_entry(out_dir, f) for f in sorted(stage_dir.iterdir()))
    return StageManifest(
        index=stage.index, first_layer=stage.first_layer, last_layer=stage.last_layer,
        has_embedding=stage.has_embedding, has_head=stage.has_head, directory=stage_dir.name,
        xml=f"{stage_dir.name}/{XML_NAME}", files=files, inputs=inputs, outputs=outputs,
        beam_idx=options.beam_idx, kv_cache_precision=options.kv_cache_precision,
        estimated_memory_bytes=estimate_memory(shape, stage, sum(f.size for f in files),
                                               options.kv_cache_precision, options.context_for_estimate),
    )


def _eos_ids(checkpoint_dir: Path, config: dict[str, Any]) -> tuple[int, ...]:
    eos: Any = None
    gen = checkpoint_dir / "generation_config.json"
    if checkpoint_dir.is_dir() and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def _copy_tokenizer(checkpoint_dir: Path, out_dir: Path) -> tuple[FileEntry, ...]:
    present = [checkpoint_dir / n for n in TOKENIZER_FILES if (checkpoint_dir / n).is_file()]
    if not present:
        return ()
    (out_dir / "tokenizer").mkdir()
    for f in present:
        shutil.copy2(f, out_dir / "tokenizer" / f.name)
    return tuple(file_entry(out_dir, out_dir / "tokenizer" / f.name) for f in present)


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int:
    """Current RSS in bytes, after resetting the kernel's peak mark (VmHWM, clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    current = _status_kb("VmRSS")
    return current * 1024 if current is not None else _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = _status_kb("VmHWM")
    return peak * 1024 if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _prepare_out_dir(out: Path, force: bool) -> Path:
    occupied = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if occupied and not force:
        raise BuildError(f"{out} already exists and is not empty; choose another --out or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_export(checkpoint: Path | str, out_dir: Path | str, options: Any, *, stages: int | None = None,
                 split: Sequence[int] | None = None, source: Any = None, name: str | None = None,
                 fingerprint: str | None = None, progress: Progress | None = None,
                 weights_factory: WeightsFactory = _default_weights, mode: Any = None) -> BuildReport:
    """Export ``checkpoint`` (HF directory or .gguf, read through ``source``) into ``out_dir``.

    ``options`` is an :class:`export.stage_parts.ExportOptions` (stateful target); ``source`` a
    TensorSource (default: ``export.weights.checkpoint.open_checkpoint(checkpoint)``).
    """
    started = time.perf_counter()
    baseline = _reset_peak_rss()
    ckpt, out = Path(checkpoint), Path(out_dir)
    opened = None
    if source is None:
        from export.weights.checkpoint import open_checkpoint

        source = opened = open_checkpoint(ckpt)
    try:
        return _build(ckpt, out, options, source, stages, split, name, fingerprint, progress, weights_factory,
                      mode, started, baseline)
    finally:
        if opened is not None and hasattr(opened, "close"):
            opened.close()


def _build(ckpt: Path, out: Path, options: Any, source: Any, stages: int | None, split: Sequence[int] | None,
           name: str | None, fingerprint: str | None, progress: Progress | None, weights_factory: WeightsFactory,
           mode: Any, started: float, baseline: int) -> BuildReport:
    config = source.config
    shape = model_shape(config)
    validate(shape, options)
    plan = plan_stages(shape.num_layers, stages, split)
    if fingerprint is None:
        from export.sources import model_fingerprint

        fingerprint = model_fingerprint(ckpt)
    progress = progress or (lambda i, step: None)
    tmp = _prepare_out_dir(out, options.force)
    try:
        stage_manifests = tuple(export_stage(source, shape, s, options, tmp, progress, weights_factory, mode)
                                for s in plan)
        tokenizer_files = _copy_tokenizer(ckpt, tmp) if ckpt.is_dir() else ()
        manifest = Manifest(
            format_version=format_version_for("stateful"),
            model=ModelInfo(
                name=name or ckpt.name, fingerprint=fingerprint, architecture=shape.family.model_type,
                num_layers=shape.num_layers, hidden_size=shape.hidden, vocab_size=shape.vocab,
                num_attention_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                max_position_embeddings=shape.max_positions, bos_token_id=config.get("bos_token_id"),
                eos_token_ids=_eos_ids(ckpt, config),
            ),
            weights=WeightInfo(format=options.weights,
                               group_size=options.group_size if options.weights == "int4" else None,
                               symmetric=options.symmetric),
            stages=stage_manifests,
            tokenizer_files=tokenizer_files,
            exporter=f"deskfleet {__version__}",
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            extra={"options": asdict(options) if is_dataclass(options) else dict(vars(options)),
                   "beam_idx_input": BEAM_IDX if options.beam_idx else None, "builder": "graph"},
            target="stateful",
            static=None,
        )
        (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildReport(out_dir=out, manifest=manifest, seconds=time.perf_counter() - started,
                       peak_rss_bytes=_peak_rss_bytes(), baseline_rss_bytes=baseline,
                       stage_file_bytes=tuple(sum(f.size for f in s.files) for s in stage_manifests))
