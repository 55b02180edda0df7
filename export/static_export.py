"""The NPU export path: static shapes, stateless graphs, one graph per use.

An NPU stage is converted once, then pinned to fixed shapes per graph (decode, an optional
prefill chunk, or the packed multi-slot graph) and left without ReadValue/Assign state; the
graph edits live in :mod:`export.static_graph`. The settings are fixed into the IR shapes, so
:func:`validate_target` refuses every inconsistency before anything is loaded.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import openvino as ov
import torch

from engine.shards.manifest import TARGETS, GraphEntry, StageManifest, StaticInfo, file_entry
from export.architectures import ArchSpec, head_dim
from export.compress import PRESETS, compress
from export.graph import convert_torch, set_io_names
from export.modeling import StageModel, StageSpec, stage_tensor_names
from export.stage_parts import (
    CheckpointReader,
    ExportError,
    ExportOptions,
    Progress,
    estimate_memory,
    example_inputs,
    io_names,
    spec_of,
)
from export.static_graph import (
    check_stateless,
    check_static,
    make_static,
    replace_mask_with_input,
    static_shapes,
)

MIN_SLOT_REGION = 2  # past positions per packed slot; below this a slot cannot hold a sequence


def static_graph_plan(static: StaticInfo) -> list[tuple[str, int, str]]:
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
        base = convert_torch(module, example_inputs(config, stage, stateless=True))
    del module
    gc.collect()
    inputs, outputs = io_names(stage, stateless=True)
    set_io_names(base, inputs, outputs)
    progress(stage.index, "static")
    plan = static_graph_plan(static)
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
                                  inputs=tuple(spec_of(p) for p in model.inputs),
                                  outputs=tuple(spec_of(p) for p in model.outputs)))
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
        estimated_memory_bytes=estimate_memory(config, stage, size, "f32", static.window),
        graphs=tuple(entries),
    )


def validate_target(config: Any, options: ExportOptions) -> None:
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
