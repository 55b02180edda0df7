"""The NPU export path: static shapes, stateless graphs, one graph per use; no torch.

An NPU stage gets one graph per use (decode, an optional prefill chunk, or the packed multi-slot
graph), each built op by op at its fixed shapes by :mod:`export.builder.static_stage` from the
same lazily read, same way lowered weights as the CPU/GPU stages (:mod:`export.weights`). The
graphs of a stage share their weight constants while they are built (each IR still has its
own .bin). The settings are fixed into the IR shapes, so :func:`validate_target` refuses every
inconsistency before anything is read.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import openvino as ov

from engine.errors import DeskfleetError
from engine.shards.manifest import TARGETS, GraphEntry, StageManifest, StaticInfo, file_entry
from export.builder.export import (
    WeightsFactory,
    check_tensors,
    default_weights,
    estimate_memory,
    port_spec,
    weight_mode,
)
from export.builder.families import ModelShape
from export.builder.stage_graph import StagePlan, head_tensor
from export.builder.static_stage import MaskKind, build_static_stage_model
from export.options import ExportError, ExportOptions, Progress

MIN_SLOT_REGION = 2  # past positions per packed slot; below this a slot cannot hold a sequence


class StaticShapeError(DeskfleetError):
    """A graph meant for the NPU has a dynamic dimension or holds state (an exporter bug)."""


def dynamic_outputs(model: ov.Model, limit: int = 5) -> list[str]:
    """Up to ``limit`` descriptions of node outputs whose shape or rank is not fully static."""
    found: list[str] = []
    for op in model.get_ordered_ops():
        for i in range(op.get_output_size()):
            shape = op.get_output_partial_shape(i)
            if not shape.is_static:
                found.append(f"{op.get_type_name()} {op.get_friendly_name()!r} output {i} {shape}")
                if len(found) >= limit:
                    return found
    return found


def check_static(model: ov.Model, when: str) -> None:
    """Raise :class:`StaticShapeError` naming the first dynamic outputs of ``model``.

    Checked on every node, not only the ports: the paper found INT4 decompression subgraphs that
    reintroduce a dynamic dimension which CPU and GPU tolerate and the NPU refuses at load time.
    """
    bad = dynamic_outputs(model)
    if bad:
        raise StaticShapeError(
            f"the NPU graph has dynamic dimensions {when}: " + "; ".join(bad)
            + ". The NPU compiles only fully static graphs; this is an exporter bug for this "
            "architecture or weight format - please report it (try --weights fp16 meanwhile)"
        )


def check_stateless(model: ov.Model) -> None:
    """An NPU graph must carry no ReadValue/Assign state: its KV lives on the host."""
    if model.get_sinks() or any(op.get_type_name() == "ReadValue" for op in model.get_ops()):
        raise StaticShapeError("the NPU graph holds state variables (ReadValue/Assign); the NPU "
                               "cannot compile them - export with --target npu, not a stateful shard")


def static_graph_plan(static: StaticInfo) -> list[tuple[str, int, MaskKind]]:
    """(name, rows, mask kind) of every graph an NPU stage gets."""
    if static.slots > 1:
        return [("packed", static.slots, "4d")]
    plan: list[tuple[str, int, MaskKind]] = [("decode", 1, "2d")]
    if static.prefill_chunk:
        plan.append(("prefill", static.prefill_chunk, "2d"))
    return plan


def export_static_stage(source: Any, shape: ModelShape, stage: StagePlan, options: ExportOptions, out_dir: Path,
                        progress: Progress, weights_factory: WeightsFactory = default_weights) -> StageManifest:
    """Build, check and save every graph of one NPU stage into ``out_dir/stage_{index}``.

    Every graph of a stage reads the same host KV window W = context - slots (the prefill chunk
    included), so the host ring is shared byte for byte between them.
    """
    static = options.static
    assert static is not None
    progress(stage.index, "load")
    check_tensors(source, shape, [stage])
    head = head_tensor(shape, source.names())
    stage_dir = out_dir / f"stage_{stage.index}"
    stage_dir.mkdir(parents=True)
    # The five steps progress consumers know (export.cli, the console's export job): the build
    # is "convert", pinning shapes "static", lowering weights "compress" (both part of the build).
    progress(stage.index, "convert")
    entries = []
    scratch = out_dir / f".stage_{stage.index}.weights"
    with weights_factory(source, weight_mode(options), scratch) as weights:
        for k, (name, rows, mask) in enumerate(static_graph_plan(static)):
            model = build_static_stage_model(shape, stage, weights, head, rows=rows, window=static.window, mask=mask)
            if k == 0:
                progress(stage.index, "static")
                progress(stage.index, "compress")
            # The paper found decompression subgraphs that bring back a dynamic dimension, which
            # CPU and GPU tolerate and the NPU refuses at load time: check the graph as saved.
            check_static(model, "with its weights lowered")
            check_stateless(model)
            if k == 0:
                progress(stage.index, "save")
            ov.save_model(model, stage_dir / f"{name}.xml", compress_to_fp16=False)
            entries.append(GraphEntry(name=name, xml=f"{stage_dir.name}/{name}.xml", rows=rows, mask=mask,
                                      inputs=tuple(port_spec(p) for p in model.inputs),
                                      outputs=tuple(port_spec(p) for p in model.outputs)))
            del model
    gc.collect()
    files = tuple(file_entry(out_dir, f) for f in sorted(stage_dir.iterdir()))
    main = entries[0]
    return StageManifest(
        index=stage.index, first_layer=stage.first_layer, last_layer=stage.last_layer,
        has_embedding=stage.has_embedding, has_head=stage.has_head, directory=stage_dir.name,
        xml=main.xml, files=files, inputs=main.inputs, outputs=main.outputs, beam_idx=False,
        kv_cache_precision="f32",
        estimated_memory_bytes=estimate_memory(shape, stage, sum(f.size for f in files), "f32", static.window),
        graphs=tuple(entries),
    )


def validate_target(max_positions: int, options: ExportOptions) -> None:
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
    if not 2 <= context <= max_positions:
        raise ExportError(f"--context {context} is out of range: it must be between 2 and the "
                          f"model's {max_positions} positions")
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
