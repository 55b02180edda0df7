"""One stateful stage on disk, built by the graph builder (no torch).

Per stage: open a :class:`StageWeights` for the stage's weight mode, build the graph op by op
(:func:`build_stage_model`), save the IR and describe it as a :class:`StageManifest` (inputs, outputs, per-layer state
names as the engine expects them). The NPU target's static stages: :mod:`export.static_export`.
:func:`export.exporter.export_model` owns the rest: the plan, the temporary sibling directory
renamed into place, the manifest, the tokenizer.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openvino as ov

from engine.errors import DeskfleetError
from engine.shards.kv_precision import KV_BYTES_PER_VALUE
from engine.shards.manifest import StageManifest, StageMoe, TensorSpec, file_entry, ir_paths
from export.builder.families import ModelShape
from export.builder.gemma4_graph import build_gemma4_stage, gemma4_tensor_names
from export.builder.stage_graph import StagePlan, build_stage_model, head_tensor, stage_tensor_names
from export.weights.stage_weights import StageWeights, WeightMode

XML_NAME = "openvino_model.xml"
Progress = Callable[[int, str], None]
# (source, WeightMode, bin path or None) -> a StageWeights context manager
WeightsFactory = Callable[[Any, Any, Path | None], Any]


class BuildError(DeskfleetError):
    """A stage cannot be built from this checkpoint (a tensor it needs is missing)."""


def weight_mode(options: Any):
    """The StageWeights mode of the CLI's --weights / --group-size / --asym."""
    if options.weights == "int4":
        return WeightMode("int4_sym" if options.symmetric else "int4_asym", options.group_size)
    return WeightMode({"int8": "int8_asym", "fp16": "fp16", "fp32": "fp32", "keep": "gguf_keep"}[options.weights])


def default_weights(source: Any, mode: Any, bin_path: Path | None) -> Any:
    return StageWeights(source, mode, bin_path)


def tensor_names(shape: ModelShape, stage: StagePlan, available: frozenset[str]) -> list[str]:
    """Exactly the checkpoint tensors the stage's graph reads (its family's builder decides)."""
    if shape.gemma4 is not None:
        return gemma4_tensor_names(shape, stage, head_tensor(shape, available))
    return stage_tensor_names(shape, stage, available)


def build_model(shape: ModelShape, stage: StagePlan, weights: Any, head: str, beam_idx: bool) -> ov.Model:
    """The stage's stateful graph, by its family's builder."""
    build = build_gemma4_stage if shape.gemma4 is not None else build_stage_model
    return build(shape, stage, weights, head, beam_idx)


def port_spec(port: ov.Output) -> TensorSpec:
    dims = tuple(-1 if d.is_dynamic else d.get_length() for d in port.get_partial_shape())
    return TensorSpec(name=port.get_any_name(), dtype=port.get_element_type().get_type_name(), shape=dims)


def estimate_memory(shape: ModelShape, stage: StagePlan, file_bytes: int, kv_precision: str, context: int) -> int:
    """Shard files + KV at ``context`` positions + compiled-graph scratch (measured order of magnitude)."""
    values = sum(kv * d for kv, d in (shape.kv_geometry(i) for i in stage.layers))
    per_position = 2 * values * KV_BYTES_PER_VALUE[kv_precision]
    return file_bytes + per_position * context + 64 * 1024 * 1024


def expert_weight_bytes(model: ov.Model, experts: int) -> int:
    """Bytes of the stacked expert weights (codes, scales, zero points: the constants of shape
    [E, ...] under each GroupedMatMul's weight input), i.e. what a step reads only in part."""
    seen: set[int] = set()
    total = 0
    todo = [op.input_value(1).get_node() for op in model.get_ordered_ops() if op.get_type_name() == "GroupedMatMul"]
    while todo:
        node = todo.pop()
        if node.get_instance_id() in seen:
            continue
        seen.add(node.get_instance_id())
        if node.get_type_name() == "Constant":
            dims = node.get_output_shape(0)
            if len(dims) >= 3 and dims[0] == experts:
                total += node.get_byte_size()
            continue
        todo.extend(v.get_node() for v in node.input_values())
    return total


def stage_moe(shape: ModelShape, model: ov.Model, weight_file_bytes: int) -> StageMoe | None:
    """The manifest's MoE entry of a stage just built (None for a dense model)."""
    if shape.moe is None:
        return None
    expert = expert_weight_bytes(model, shape.moe.experts)
    return StageMoe(experts=shape.moe.experts, per_token=shape.moe.per_token, expert_bytes=expert,
                    dense_bytes=max(weight_file_bytes - expert, 0))


# Tensors a checkpoint may hold that no stage reads, on purpose: the rotary buffers older HF
# checkpoints saved (the builder computes rotary from the config).
_UNREAD_ON_PURPOSE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def unread_tensors(shape: ModelShape, plan: list[StagePlan], available: frozenset[str]) -> list[str]:
    """The checkpoint's tensors that no stage of ``plan`` (the whole model) reads, sorted."""
    read: set[str] = set()
    for stage in plan:
        read.update(tensor_names(shape, stage, available))
    if shape.tied:
        read.add(shape.family.head)  # a tied model's head is its embedding, whatever else is saved
    return sorted(n for n in available - read if not _UNREAD_ON_PURPOSE.search(n))


def _whole_model(shape: ModelShape, plan: list[StagePlan]) -> bool:
    layers = sorted(i for stage in plan for i in stage.layers)
    return (layers == list(range(shape.num_layers)) and any(s.has_embedding for s in plan)
            and any(s.has_head for s in plan))


def check_tensors(source: Any, shape: ModelShape, plan: list[StagePlan]) -> None:
    """Refuse a checkpoint that lacks a tensor any stage needs, before anything is built; for a
    plan of the whole model, also one holding a tensor no stage would read (a bias the config does
    not announce, say), which would otherwise be dropped silently and change the model's math."""
    available = source.names()
    for stage in plan:
        missing = [n for n in tensor_names(shape, stage, available) if n not in available]
        if missing:
            raise BuildError(f"checkpoint tensor {missing[0]!r} is missing (stage {stage.index} needs it); "
                             "the checkpoint is incomplete: download or convert it again")
    if not _whole_model(shape, plan):
        return
    unread = unread_tensors(shape, plan, available)
    if unread:
        stored = getattr(source, "stored_name", lambda n: n)  # a GGUF's own names, for its reader

        def named(n: str) -> str:
            return repr(n) if stored(n) == n else f"{stored(n)!r} ({n})"

        shown = ", ".join(named(n) for n in unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        raise BuildError(
            f"the checkpoint holds tensors that no stage of this {shape.family.title} model would read: {shown}. "
            "Leaving them out would change the model's math. Either the config lacks the option that uses them "
            "(attention_bias, mlp_bias, tie_word_embeddings) or this variant of the architecture is not supported")


def export_stage(source: Any, shape: ModelShape, stage: StagePlan, options: Any, out_dir: Path,
                 progress: Progress, weights_factory: WeightsFactory = default_weights) -> StageManifest:
    """Build and save one stage into ``out_dir/stage_{index}``."""
    # Progress consumers (export.cli.EXPORT_STEPS, the console's export job) know five steps per
    # stage, in order (the torch exporter's). Here "convert" is the whole build: the graph is
    # written with its state ("stateful") and each weight is lowered ("compress") as the graph
    # reaches it, so those two are reported as done when the build returns.
    progress(stage.index, "load")
    check_tensors(source, shape, [stage])
    available = source.names()
    stage_dir = out_dir / f"stage_{stage.index}"
    stage_dir.mkdir(parents=True)
    progress(stage.index, "convert")
    # Constants go to a scratch file as they are produced and are memory-mapped back, so the
    # stage is never whole in anonymous memory; closing the weights deletes it.
    scratch = out_dir / f".stage_{stage.index}.weights"
    with weights_factory(source, weight_mode(options), scratch) as weights:
        model = build_model(shape, stage, weights, head_tensor(shape, available), options.beam_idx)
        model.set_rt_info(options.kv_cache_precision, ["runtime_options", "KV_CACHE_PRECISION"])
        progress(stage.index, "stateful")
        progress(stage.index, "compress")
        progress(stage.index, "save")
        ov.save_model(model, stage_dir / XML_NAME, compress_to_fp16=False)
        inputs = tuple(port_spec(p) for p in model.inputs)
        outputs = tuple(port_spec(p) for p in model.outputs)
        moe = stage_moe(shape, model, (stage_dir / ir_paths(XML_NAME)[1]).stat().st_size)
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
        moe=moe,
    )
