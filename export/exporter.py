"""Export a checkpoint into per-stage OpenVINO shards plus a manifest.

CPU/GPU (``target="stateful"``): each stage's graph is written op by op from the checkpoint's
tensors by :mod:`export.builder` (stateful KV with the beam_idx Gather, weights lowered one
tensor at a time by :mod:`export.weights`); no tracing, no torch, no transformers. The model is
an HF safetensors directory or a ``.gguf`` file read directly (its config and tokenizer files
come from its metadata: :mod:`export.gguf_tokenizer`); ``--weights keep`` keeps a GGUF's own
quantised blocks. A model directory that :mod:`export.sources` prepared from a GGUF (config and
tokenizer files, no weights) exports from that GGUF.

With ``target="npu"`` the same builder writes each stage as static, stateless graphs instead,
one per use (:mod:`export.static_export`), from the same weights; no torch either. Everything is
written into a temporary sibling directory and renamed into place at the end, so an error or a
crash never leaves a half-written export behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine import __version__
from engine.shards.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ModelInfo,
    StageManifest,
    WeightInfo,
    file_entry,
    format_version_for,
)
from engine.shards.tensor_names import BEAM_IDX
from export.builder.families import ModelShape, model_shape
from export.builder.stage_graph import StagePlan
from export.options import WEIGHT_FORMATS, ExportError, ExportOptions, Progress, check_group_size

__all__ = ["ExportError", "ExportOptions", "ExportReport", "Progress", "export_model", "plan_stages",
           "read_config"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
KV_PRECISIONS = ("f32", "f16", "u8")


@dataclass(frozen=True)
class ExportReport:
    out_dir: Path
    manifest: Manifest
    seconds: float
    stage_file_bytes: tuple[int, ...]


def plan_stages(num_layers: int, stages: int | None = None, split: Sequence[int] | None = None) -> list[StagePlan]:
    """Contiguous layer ranges from ``--stages N`` (as even as possible) or ``--split a,b,...``."""
    if (stages is None) == (split is None):
        raise ExportError("give exactly one of --stages N or --split A,B,...")
    if stages is not None:
        if not 1 <= stages <= num_layers:
            raise ExportError(f"--stages {stages} is out of range: this model has {num_layers} layers "
                              f"(1..{num_layers} stages)")
        base, extra = divmod(num_layers, stages)
        cuts, at = [], 0
        for i in range(stages - 1):
            at += base + (1 if i < extra else 0)
            cuts.append(at)
        split = cuts
    cuts = list(split or [])
    if any(not 0 < c < num_layers for c in cuts) or cuts != sorted(set(cuts)):
        raise ExportError(
            f"--split {','.join(map(str, cuts))} is out of range: cut points must be increasing layer "
            f"numbers between 1 and {num_layers - 1} (this model has {num_layers} layers)"
        )
    bounds = [0, *cuts, num_layers]
    return [
        StagePlan(index=i, first_layer=bounds[i], last_layer=bounds[i + 1] - 1,
                  has_embedding=i == 0, has_head=i == len(bounds) - 2)
        for i in range(len(bounds) - 1)
    ]


def _eos_ids(tokenizer_dir: Path, config: dict) -> tuple[int, ...]:
    eos: Any = None
    gen = tokenizer_dir / "generation_config.json"
    if gen.is_file():
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
    tok_dir = out_dir / "tokenizer"
    tok_dir.mkdir()
    for f in present:
        shutil.copy2(f, tok_dir / f.name)
    return tuple(file_entry(out_dir, tok_dir / f.name) for f in present)


def _validate_options(shape: ModelShape, options: ExportOptions, gguf: Path | None) -> None:
    # here: the fleet service imports this module for ExportOptions; the NPU builder loads only for an export
    from export.static_export import validate_target

    validate_target(shape.max_positions, options)
    if shape.moe is not None and options.target != "stateful":
        raise ExportError(f"{shape.family.title} is a mixture-of-experts model: the NPU target does not build its "
                          "expert blocks (GroupedMatMul); export it for --target stateful (CPU/GPU, paged or not)")
    if shape.gemma4 is not None and options.target != "stateful":
        raise ExportError(f"{shape.family.title}: the NPU target does not build Gemma 4's layers (sliding windows, "
                          "shared K/V, per-layer embeddings); export it for --target stateful (CPU/GPU, paged or not)")
    if options.weights not in WEIGHT_FORMATS:
        raise ExportError(f"unknown --weights {options.weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if options.weights == "keep" and (gguf is None or options.target != "stateful"):
        raise ExportError("--weights keep keeps a GGUF's own quantisation: it needs a .gguf model and the "
                          "stateful (CPU/GPU) target; for a safetensors checkpoint choose int4, int8, fp16 or fp32")
    if options.kv_cache_precision not in KV_PRECISIONS:
        raise ExportError(f"unknown KV cache precision {options.kv_cache_precision!r}; "
                          f"choose one of {', '.join(KV_PRECISIONS)}")
    if options.weights == "int4":
        check_group_size(options.group_size, {
            "hidden size": shape.hidden,
            "intermediate size": shape.intermediate,
            "attention width": shape.heads * shape.head_dim,
            **({"expert intermediate size": shape.moe.intermediate} if shape.moe is not None else {}),
            **(_gemma4_widths(shape) if shape.gemma4 is not None else {}),
        })


def _gemma4_widths(shape: ModelShape) -> dict[str, int]:
    """The input widths of Gemma 4's other matrices: full-attention heads, double-wide MLPs, PLE."""
    g = shape.gemma4
    assert g is not None
    widths = {"full-attention width": shape.heads * max(g.head_dims), "widest MLP": max(g.intermediates)}
    return widths | ({"per-layer input width": g.ple_dim} if g.ple_dim else {})


def _gguf_tokenizer(gguf: Path, source: Any, out_dir: Path) -> tuple[FileEntry, ...]:
    """The GGUF's tokenizer as HF tokenizer files (torch-free), into ``out_dir/tokenizer``."""
    # here: the GGUF reader loads only for a GGUF source
    from export.gguf_tokenizer import GGUFTokenizerError, write_tokenizer_files

    try:
        written = write_tokenizer_files(gguf, out_dir / "tokenizer", metadata=getattr(source, "metadata", None))
    except GGUFTokenizerError as exc:
        raise ExportError(str(exc)) from exc
    return tuple(file_entry(out_dir, f) for f in sorted(written))


def _prepare_out_dir(out: Path, force: bool) -> Path:
    occupied = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if occupied and not force:
        raise ExportError(f"{out} already exists and is not empty; choose another --out or pass --force to replace it")
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


def read_config(model: Path | str) -> dict:
    """The HF config dict of a model: its config.json, or a GGUF's metadata mapped to HF keys."""
    model = Path(model)
    gguf = _gguf_weights(model)
    if gguf is not None and (model == gguf or not (model / "config.json").is_file()):
        # here: the GGUF reader loads only for a GGUF source
        from export.weights.gguf_source import GGUFSource

        with GGUFSource(gguf) as source:
            return dict(source.config)
    path = model / "config.json"
    if not path.is_file():
        raise ExportError(f"{model} is not an HF checkpoint directory (no config.json) nor a .gguf file")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path} is not readable JSON ({exc}); re-save the checkpoint") from exc
    if not isinstance(config, dict):
        raise ExportError(f"{path} is not a JSON object; re-save the checkpoint")
    return config


def _gguf_weights(model: Path) -> Path | None:
    """The GGUF whose tensors an export of ``model`` reads, or None for a safetensors directory."""
    if model.is_file() and model.suffix.lower() == ".gguf":
        return model
    if model.is_dir():
        # A model directory prepared from a GGUF (an older Deskfleet's entry also holds a
        # transformers conversion of it: the GGUF is still the source, so every machine agrees).
        from export.sources import gguf_of

        gguf = gguf_of(model)
        if gguf is not None and (gguf.is_file() or not any(model.glob("*.safetensors"))):
            return gguf
    return None


def _open_source(model: Path, gguf: Path | None) -> Any:
    # here: the fleet service imports this module for ExportOptions; weights load only for an export
    from export.weights.checkpoint import CheckpointError, open_checkpoint

    try:
        return open_checkpoint(gguf if gguf is not None else model)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc


def _export_stages(source: Any, shape: ModelShape, plan: list[StagePlan], options: ExportOptions, out_dir: Path,
                   progress: Progress) -> tuple[StageManifest, ...]:
    """The shards from :mod:`export.builder`, one stage at a time: stateful (CPU/GPU) or static (NPU)."""
    # here: the fleet service imports this module for ExportOptions; the builder loads only for an export
    from export.builder.export import BuildError, check_tensors
    from export.builder.export import export_stage as build_stage
    from export.static_export import export_static_stage

    export_one = export_static_stage if options.target == "npu" else build_stage
    try:
        check_tensors(source, shape, plan)
        return tuple(export_one(source, shape, p, options, out_dir, progress) for p in plan)
    except BuildError as exc:
        raise ExportError(str(exc)) from exc


def export_model(checkpoint_dir: Path | str, out_dir: Path | str, *, stages: int | None = None,
                 split: Sequence[int] | None = None, options: ExportOptions = ExportOptions(),  # noqa: B008 (frozen)
                 name: str | None = None, fingerprint: str | None = None,
                 progress: Progress | None = None) -> ExportReport:
    """Export ``checkpoint_dir`` (an HF checkpoint directory, a ``.gguf`` file, or a model
    directory prepared from a GGUF) into ``out_dir``; see the module docstring."""
    started = time.perf_counter()
    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    gguf = _gguf_weights(ckpt)
    if gguf is None and not (ckpt / "config.json").is_file():
        raise ExportError(f"{ckpt} is not an HF checkpoint directory (no config.json) nor a .gguf file")
    source = _open_source(ckpt, gguf)
    try:
        config = dict(source.config)
        shape = model_shape(config)
        _validate_options(shape, options, gguf)
        if shape.gemma4 is not None and shape.moe is not None:  # stacked experts, read as one matrix per expert
            # here: the fleet service imports this module for ExportOptions; weights load only for an export
            from export.weights.expert_views import ExpertViews
            source = ExpertViews(source)
        plan = plan_stages(shape.num_layers, stages, split)
        if fingerprint is None:
            # here: model sources (hashing, tokenizers) load only when no fingerprint is given
            from export.sources import model_fingerprint

            fingerprint = model_fingerprint(ckpt)
        progress = progress or (lambda i, step: None)
        tmp = _prepare_out_dir(out, options.force)
        try:
            # The tokenizer first: a GGUF whose tokenizer does not convert is refused before any stage is built.
            tokenizer_files = _copy_tokenizer(ckpt, tmp) if gguf is None else _gguf_tokenizer(gguf, source, tmp)
            stage_manifests = _export_stages(source, shape, plan, options, tmp, progress)
            tokenizer_dir = tmp / "tokenizer" if tokenizer_files else ckpt
            weights_name = options.weights
            manifest = Manifest(
                format_version=format_version_for(options.target),
                model=ModelInfo(
                    name=name or (gguf.stem if gguf is not None and ckpt == gguf else ckpt.name),
                    fingerprint=fingerprint,
                    architecture=shape.family.model_type,
                    num_layers=shape.num_layers,
                    hidden_size=shape.hidden,
                    vocab_size=shape.vocab,
                    num_attention_heads=shape.heads,
                    # the widest layer's: block estimates (engine.paged.kv_pool) stay upper bounds
                    num_kv_heads=shape.widest_kv[0],
                    head_dim=shape.widest_kv[1],
                    max_position_embeddings=shape.max_positions,
                    bos_token_id=config.get("bos_token_id"),
                    eos_token_ids=_eos_ids(tokenizer_dir, config),
                ),
                weights=WeightInfo(format=weights_name,
                                   group_size=options.group_size if options.weights == "int4" else None,
                                   symmetric=options.symmetric),
                stages=stage_manifests,
                tokenizer_files=tokenizer_files,
                exporter=f"deskfleet {__version__}",
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                extra={"options": asdict(options),
                       "beam_idx_input": BEAM_IDX if options.beam_idx and options.target == "stateful" else None},
                target=options.target,
                static=options.static,
            )
            (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
            _commit(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    return ExportReport(
        out_dir=out,
        manifest=manifest,
        seconds=time.perf_counter() - started,
        stage_file_bytes=tuple(sum(f.size for f in s.files) for s in stage_manifests),
    )
