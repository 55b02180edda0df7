"""Export a checkpoint into per-stage OpenVINO shards plus a manifest.

CPU/GPU (``target="stateful"``): each stage's graph is written op by op from the checkpoint's
tensors by :mod:`export.builder` (stateful KV with the beam_idx Gather, weights lowered one
tensor at a time by :mod:`export.weights`); no tracing (the traced torch path this replaced
is in the history before this change, for comparison benchmarks).
With ``target="npu"`` each stage is built by :mod:`export.static_export` instead (static
shapes, stateless graphs, one graph per use); the parts both builders share are in
:mod:`export.stage_parts`. Everything is written into a temporary sibling directory and
renamed into place at the end, so an error or a crash never leaves a half-written export behind.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from engine import __version__
from engine.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ModelInfo,
    StageManifest,
    WeightInfo,
    file_entry,
    format_version_for,
)
from export.architectures import arch_for, head_dim
from export.compress import PRESETS, check_group_size
from export.graph import BEAM_IDX
from export.modeling import StageSpec
from export.stage_parts import (
    CheckpointReader,
    ExportError,
    ExportOptions,
    Progress,
)
from export.static_export import export_static_stage, validate_target

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
    peak_rss_bytes: int
    baseline_rss_bytes: int
    stage_file_bytes: tuple[int, ...]


def plan_stages(num_layers: int, stages: int | None = None, split: Sequence[int] | None = None) -> list[StageSpec]:
    """Contiguous layer ranges from ``--stages N`` (as even as possible) or ``--split a,b,...``."""
    if (stages is None) == (split is None):
        raise ExportError("give exactly one of --stages N or --split A,B,...")
    if stages is not None:
        if not 1 <= stages <= num_layers:
            raise ExportError(f"--stages {stages} is out of range: this model has {num_layers} layers (1..{num_layers} stages)")
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
        StageSpec(index=i, first_layer=bounds[i], last_layer=bounds[i + 1] - 1,
                  has_embedding=i == 0, has_head=i == len(bounds) - 2)
        for i in range(len(bounds) - 1)
    ]


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int:
    """Current RSS in bytes, after resetting the kernel's peak-RSS mark where that is possible.

    ``ru_maxrss`` survives exec, so a process spawned by a large parent would report the
    parent's size; Linux's VmHWM belongs to this process alone and can be reset (clear_refs 5).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    current = _status_kb("VmRSS")
    return current * 1024 if current is not None else _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = _status_kb("VmHWM")
    return peak * 1024 if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _eos_ids(checkpoint_dir: Path, config: Any) -> tuple[int, ...]:
    eos: Any = None
    gen = checkpoint_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
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


def _validate_options(config: Any, options: ExportOptions) -> None:
    validate_target(config, options)
    if options.weights not in PRESETS:
        raise ExportError(f"unknown --weights {options.weights!r}; choose one of {', '.join(PRESETS)}")
    if options.kv_cache_precision not in KV_PRECISIONS:
        raise ExportError(f"unknown KV cache precision {options.kv_cache_precision!r}; choose one of {', '.join(KV_PRECISIONS)}")
    if options.weights == "int4":
        check_group_size(options.group_size, {
            "hidden size": int(config.hidden_size),
            "intermediate size": int(config.intermediate_size),
            "attention width": int(config.num_attention_heads) * head_dim(config),
        })


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


def _export_built(ckpt: Path, plan: list[StageSpec], options: ExportOptions, out_dir: Path,
                  progress: Progress) -> tuple[StageManifest, ...]:
    """CPU/GPU shards from :mod:`export.builder`, one stage at a time."""
    from export.builder.export import BuildError, check_tensors
    from export.builder.export import export_stage as build_stage
    from export.builder.families import model_shape
    from export.builder.stage_graph import StagePlan
    from export.weights.checkpoint import open_checkpoint

    source = open_checkpoint(ckpt)
    try:
        shape = model_shape(source.config)
        plans = [StagePlan(s.index, s.first_layer, s.last_layer, s.has_embedding, s.has_head) for s in plan]
        check_tensors(source, shape, plans)
        return tuple(build_stage(source, shape, p, options, out_dir, progress) for p in plans)
    except BuildError as exc:
        raise ExportError(str(exc)) from exc
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def export_model(checkpoint_dir: Path | str, out_dir: Path | str, *, stages: int | None = None,
                 split: Sequence[int] | None = None, options: ExportOptions = ExportOptions(),  # noqa: B008 (frozen)
                 name: str | None = None, fingerprint: str | None = None,
                 progress: Progress | None = None) -> ExportReport:
    """Export ``checkpoint_dir`` into ``out_dir``; see the module docstring."""
    started = time.perf_counter()
    baseline = _reset_peak_rss()
    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    if not (ckpt / "config.json").is_file():
        raise ExportError(f"{ckpt} is not an HF checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(ckpt)
    spec = arch_for(config)
    if options.target == "npu" and not spec.traced:
        raise ExportError(f"the NPU target does not support {spec.family} yet; export it for CPU/GPU "
                          "(without --target npu) or choose a Llama, Mistral or Qwen2 checkpoint")
    _validate_options(config, options)
    plan = plan_stages(int(config.num_hidden_layers), stages, split)
    if fingerprint is None:
        from export.sources import model_fingerprint

        fingerprint = model_fingerprint(ckpt)
    progress = progress or (lambda i, step: None)
    tmp = _prepare_out_dir(out, options.force)
    try:
        if options.target == "npu":
            reader = CheckpointReader(ckpt)
            stage_manifests = tuple(export_static_stage(config, spec, reader, s, options, tmp, progress) for s in plan)
        else:
            stage_manifests = _export_built(ckpt, plan, options, tmp, progress)
        tokenizer_files = _copy_tokenizer(ckpt, tmp)
        kv = int(config.num_key_value_heads)
        manifest = Manifest(
            format_version=format_version_for(options.target),
            model=ModelInfo(
                name=name or ckpt.name,
                fingerprint=fingerprint,
                architecture=spec.model_type,
                num_layers=int(config.num_hidden_layers),
                hidden_size=int(config.hidden_size),
                vocab_size=int(config.vocab_size),
                num_attention_heads=int(config.num_attention_heads),
                num_kv_heads=kv,
                head_dim=head_dim(config),
                max_position_embeddings=int(config.max_position_embeddings),
                bos_token_id=getattr(config, "bos_token_id", None),
                eos_token_ids=_eos_ids(ckpt, config),
            ),
            weights=WeightInfo(format=options.weights,
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
    return ExportReport(
        out_dir=out,
        manifest=manifest,
        seconds=time.perf_counter() - started,
        peak_rss_bytes=_peak_rss_bytes(),
        baseline_rss_bytes=baseline,
        stage_file_bytes=tuple(sum(f.size for f in s.files) for s in stage_manifests),
    )

