"""Export a checkpoint into per-stage OpenVINO shards plus a manifest.

Per stage: load only that stage's tensors, build the traceable stage module, convert it,
make the KV cache stateful (with the beam_idx Gather), compress the weights, save the IR.
With ``target="npu"`` the stage is instead pinned to static shapes and left stateless, as one
graph per use (decode, optional prefill chunk, or the packed multi-slot graph); see
:mod:`export.static_graph`. Everything is written into a temporary sibling directory and renamed into place at the end,
so an error or a crash never leaves a half-written export behind.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import openvino as ov
import torch
from safetensors import safe_open
from transformers import AutoConfig

from engine import __version__
from engine.errors import DeskfleetError
from engine.manifest import (
    MANIFEST_NAME,
    TARGETS,
    FileEntry,
    GraphEntry,
    Manifest,
    ModelInfo,
    StageManifest,
    StaticInfo,
    TensorSpec,
    WeightInfo,
    file_entry,
    format_version_for,
)
from export.architectures import ArchSpec, arch_for, head_dim
from export.compress import PRESETS, check_group_size, compress
from export.graph import BEAM_IDX, convert_torch, make_stateful, set_io_names, set_runtime_options
from export.modeling import StageModel, StageSpec, stage_tensor_names
from export.static_graph import (
    check_stateless,
    check_static,
    make_static,
    replace_mask_with_input,
    static_shapes,
)

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
XML_NAME = "openvino_model.xml"
MIN_SLOT_REGION = 2  # past positions per packed slot; below this a slot cannot hold a sequence


class ExportError(DeskfleetError):
    """The export request is invalid (split out of range, output exists, checkpoint unreadable)."""


@dataclass(frozen=True)
class ExportOptions:
    weights: str = "int4"
    group_size: int = 64
    symmetric: bool = True
    kv_cache_precision: str = "f16"
    beam_idx: bool = True
    context_for_estimate: int = 4096
    force: bool = False
    target: str = "stateful"  # or "npu": static, stateless graphs
    context: int | None = None  # NPU: attention length T of the decode / packed graph
    slots: int = 1  # NPU: > 1 makes the packed graph with this many query rows
    prefill_chunk: int | None = None  # NPU, unpacked: a second graph prefilling C tokens a step

    @property
    def static(self) -> StaticInfo | None:
        if self.target != "npu" or self.context is None:
            return None
        return StaticInfo(context=self.context, slots=self.slots, prefill_chunk=self.prefill_chunk)


@dataclass(frozen=True)
class ExportReport:
    out_dir: Path
    manifest: Manifest
    seconds: float
    peak_rss_bytes: int
    baseline_rss_bytes: int
    stage_file_bytes: tuple[int, ...]


Progress = Callable[[int, str], None]  # (stage index, step name)


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


class CheckpointReader:
    """Lazy access to the tensors of an HF safetensors checkpoint, one tensor at a time."""

    def __init__(self, checkpoint_dir: Path):
        files = sorted(checkpoint_dir.glob("*.safetensors"))
        if not files:
            raise ExportError(f"{checkpoint_dir} has no *.safetensors files; is it an HF checkpoint directory?")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    self._where[key] = f

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def load(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self._where:
                raise ExportError(f"checkpoint tensor {n!r} is missing; the checkpoint is incomplete")
            by_file.setdefault(self._where[n], []).append(n)
        for f, keys in by_file.items():
            with safe_open(str(f), framework="pt") as st:
                for k in keys:
                    out[k] = st.get_tensor(k).to(torch.float32)
        return out


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


def _io_names(stage: StageSpec, stateless: bool = False) -> tuple[list[str], list[str]]:
    first = "input_ids" if stage.has_embedding else "hidden_states"
    inputs = [first, "attention_mask", "position_ids"]
    if stage.has_head and not stateless:
        inputs.append("logits_last")
    outputs = ["logits" if stage.has_head else "hidden_states_out"]
    present = "new" if stateless else "present"  # stateless graphs return only the S new positions
    for i in stage.layers:
        inputs += [f"past_key_{i}", f"past_value_{i}"]
        outputs += [f"{present}_key_{i}", f"{present}_value_{i}"]
    return inputs, outputs


def _example_inputs(config: Any, stage: StageSpec, stateless: bool = False) -> tuple[torch.Tensor, ...]:
    """Real tensors for tracing: S=3 new tokens over P=2 cached ones (every dimension converts dynamic)."""
    s, p = 3, 2
    kv, d = int(config.num_key_value_heads), head_dim(config)
    if stage.has_embedding:
        x = torch.randint(0, int(config.vocab_size), (1, s), dtype=torch.int64)
    else:
        x = torch.randn(1, s, int(config.hidden_size))
    tensors = [x, torch.ones(1, p + s, dtype=torch.int64), torch.arange(p, p + s, dtype=torch.int64)[None]]
    if stage.has_head and not stateless:
        tensors.append(torch.tensor(2, dtype=torch.int64))  # logits for the last 2 of the 3 positions
    for _ in stage.layers:
        tensors += [torch.randn(1, kv, p, d), torch.randn(1, kv, p, d)]
    return tuple(tensors)


def _spec_of(port: ov.Output) -> TensorSpec:
    shape = tuple(-1 if dim.is_dynamic else dim.get_length() for dim in port.get_partial_shape())
    return TensorSpec(name=port.get_any_name(), dtype=port.get_element_type().get_type_name(), shape=shape)


def _estimate_memory(config: Any, stage: StageSpec, file_bytes: int, kv_precision: str, context: int) -> int:
    """Shard files + KV at ``context`` positions + scratch. For an NPU stage ``context`` is the
    fixed window and the KV is the host ring (f32): it is allocated in full from the start."""
    kv_bytes = {"f32": 4, "f16": 2, "u8": 1}[kv_precision]
    per_token = 2 * stage.last_layer - 2 * stage.first_layer + 2
    kv = per_token * int(config.num_key_value_heads) * head_dim(config) * kv_bytes * context
    activations = 64 * 1024 * 1024  # compiled-graph scratch, measured order of magnitude on CPU
    return file_bytes + kv + activations


def export_stage(config: Any, spec: ArchSpec, reader: CheckpointReader, stage: StageSpec,
                 options: ExportOptions, out_dir: Path, progress: Progress) -> StageManifest:
    """Build, convert, make stateful, compress and save one stage into ``out_dir``."""
    progress(stage.index, "load")
    tensors = reader.load(stage_tensor_names(config, spec, stage, reader.names))
    module = StageModel(config, spec, stage, tensors).eval()
    del tensors
    example = _example_inputs(config, stage)
    progress(stage.index, "convert")
    with torch.no_grad():
        model = convert_torch(module, example)
    del module, example
    gc.collect()
    inputs, outputs = _io_names(stage)
    set_io_names(model, inputs, outputs)
    progress(stage.index, "stateful")
    make_stateful(model, list(stage.layers), int(config.num_key_value_heads), head_dim(config), options.beam_idx)
    progress(stage.index, "compress")
    model = compress(model, options.weights, options.group_size, options.symmetric)
    set_runtime_options(model, {"KV_CACHE_PRECISION": options.kv_cache_precision})
    progress(stage.index, "save")
    stage_dir = out_dir / f"stage_{stage.index}"
    stage_dir.mkdir(parents=True)
    ov.save_model(model, stage_dir / XML_NAME, compress_to_fp16=PRESETS[options.weights].fp16_ir)
    io_in = tuple(_spec_of(p) for p in model.inputs)
    io_out = tuple(_spec_of(p) for p in model.outputs)
    del model
    gc.collect()
    files = tuple(file_entry(out_dir, f) for f in sorted(stage_dir.iterdir()))
    size = sum(f.size for f in files)
    return StageManifest(
        index=stage.index,
        first_layer=stage.first_layer,
        last_layer=stage.last_layer,
        has_embedding=stage.has_embedding,
        has_head=stage.has_head,
        directory=stage_dir.name,
        xml=f"{stage_dir.name}/{XML_NAME}",
        files=files,
        inputs=io_in,
        outputs=io_out,
        beam_idx=options.beam_idx,
        kv_cache_precision=options.kv_cache_precision,
        estimated_memory_bytes=_estimate_memory(config, stage, size, options.kv_cache_precision,
                                                options.context_for_estimate),
    )


def _static_graph_plan(static: StaticInfo) -> list[tuple[str, int, str]]:
    """(name, rows, mask kind) of every graph an NPU stage gets."""
    if static.slots > 1:
        return [("packed", static.slots, "4d")]
    plan = [("decode", 1, "2d")]
    if static.prefill_chunk:
        plan.append(("prefill", static.prefill_chunk, "2d"))
    return plan


def export_static_stage(config: Any, spec: ArchSpec, reader: CheckpointReader, stage: StageSpec,
                        options: ExportOptions, out_dir: Path, progress: Progress) -> StageManifest:
    """Build, convert once, pin to static shapes per graph, compress, re-check and save one NPU stage.

    Every graph of a stage reads the same host KV window W = context - slots (the prefill chunk
    included), so the host ring is shared byte for byte between them.
    """
    static = options.static
    assert static is not None
    progress(stage.index, "load")
    tensors = reader.load(stage_tensor_names(config, spec, stage, reader.names))
    module = StageModel(config, spec, stage, tensors, stateless=True).eval()
    del tensors
    progress(stage.index, "convert")
    with torch.no_grad():
        base = convert_torch(module, _example_inputs(config, stage, stateless=True))
    del module
    gc.collect()
    inputs, outputs = _io_names(stage, stateless=True)
    set_io_names(base, inputs, outputs)
    progress(stage.index, "static")
    plan = _static_graph_plan(static)
    graphs = []
    for k, (_name, rows, mask) in enumerate(plan):
        model = base if k == len(plan) - 1 else base.clone()
        make_static(model, static_shapes(inputs, rows=rows, window=static.window,
                                         hidden=int(config.hidden_size),
                                         kv_heads=int(config.num_key_value_heads),
                                         head_dim=head_dim(config), has_embedding=stage.has_embedding))
        if mask == "4d":
            replace_mask_with_input(model)
            check_static(model, "after the packed-mask edit")
        check_stateless(model)
        graphs.append(model)
    del base
    progress(stage.index, "compress")
    for k, model in enumerate(graphs):
        graphs[k] = compress(model, options.weights, options.group_size, options.symmetric)
        check_static(graphs[k], "after weight compression")
    progress(stage.index, "save")
    stage_dir = out_dir / f"stage_{stage.index}"
    stage_dir.mkdir(parents=True)
    entries = []
    for (name, rows, mask), model in zip(plan, graphs, strict=True):
        ov.save_model(model, stage_dir / f"{name}.xml", compress_to_fp16=PRESETS[options.weights].fp16_ir)
        entries.append(GraphEntry(name=name, xml=f"{stage_dir.name}/{name}.xml", rows=rows, mask=mask,
                                  inputs=tuple(_spec_of(p) for p in model.inputs),
                                  outputs=tuple(_spec_of(p) for p in model.outputs)))
    del graphs, model
    gc.collect()
    files = tuple(file_entry(out_dir, f) for f in sorted(stage_dir.iterdir()))
    size = sum(f.size for f in files)
    main = entries[0]
    return StageManifest(
        index=stage.index, first_layer=stage.first_layer, last_layer=stage.last_layer,
        has_embedding=stage.has_embedding, has_head=stage.has_head, directory=stage_dir.name,
        xml=main.xml, files=files, inputs=main.inputs, outputs=main.outputs, beam_idx=False,
        kv_cache_precision="f32",
        estimated_memory_bytes=_estimate_memory(config, stage, size, "f32", static.window),
        graphs=tuple(entries),
    )


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


def _validate_target(config: Any, options: ExportOptions) -> None:
    """The NPU settings are fixed into the IR shapes, so every inconsistency is refused up front."""
    if options.target not in TARGETS:
        raise ExportError(f"unknown --target {options.target!r}; choose one of {', '.join(TARGETS)}")
    context, slots, chunk = options.context, options.slots, options.prefill_chunk
    if options.target == "stateful":
        if context is not None or slots != 1 or chunk is not None:
            raise ExportError("--context, --slots and --prefill-chunk apply to --target npu only: "
                              "stateful shards grow their cache as needed")
        return
    if context is None:
        raise ExportError("--target npu needs --context T: the attention window is fixed into the "
                          "graph at export (e.g. --context 1024)")
    limit = int(config.max_position_embeddings)
    if not 2 <= context <= limit:
        raise ExportError(f"--context {context} is out of range: it must be between 2 and the "
                          f"model's {limit} positions")
    if slots < 1:
        raise ExportError(f"--slots {slots} must be at least 1")
    if slots >= context or (context - slots) // slots < MIN_SLOT_REGION:
        raise ExportError(
            f"--slots {slots} does not fit --context {context}: each slot needs at least "
            f"{MIN_SLOT_REGION} past positions of the {context - slots}-position window "
            f"(context - slots); use at most {max((context) // (MIN_SLOT_REGION + 1), 1)} slots "
            "or a larger --context")
    if chunk is not None:
        if slots > 1:
            raise ExportError("--prefill-chunk does not apply with --slots > 1: in the packed graph "
                              "several rows of one slot already form a causal prefill chunk")
        if not 2 <= chunk < context:
            raise ExportError(f"--prefill-chunk {chunk} must be between 2 and --context - 1 ({context - 1})")


def _validate_options(config: Any, options: ExportOptions) -> None:
    _validate_target(config, options)
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


def export_model(checkpoint_dir: Path | str, out_dir: Path | str, *, stages: int | None = None,
                 split: Sequence[int] | None = None, options: ExportOptions = ExportOptions(),
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
    _validate_options(config, options)
    plan = plan_stages(int(config.num_hidden_layers), stages, split)
    if fingerprint is None:
        from export.sources import model_fingerprint

        fingerprint = model_fingerprint(ckpt)
    reader = CheckpointReader(ckpt)
    progress = progress or (lambda i, step: None)
    tmp = _prepare_out_dir(out, options.force)
    try:
        export_one = export_static_stage if options.target == "npu" else export_stage
        stage_manifests = tuple(export_one(config, spec, reader, s, options, tmp, progress) for s in plan)
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

