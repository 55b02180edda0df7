"""One pipeline stage's OpenVINO graph, built op by op from the checkpoint's tensors.

The graph has the interface the engine's stateful stages expect (the names: engine.shards.tensor_names)::

    stage 0       input_ids        [B, S]      i64   (tensor and node name: the paged-attention
    later stages  inputs_embeds    [B, S, H]   f32    conversion finds the token input by them)
    every stage   attention_mask   [B, P + S]  i64   1 = attend, 0 = masked (physical positions)
                  position_ids     [B, S]      i64   logical positions
    last stage    logits_last      []          i64   trailing positions that get logits (0 = all)
    with beam_idx beam_idx         [B]         i32   reorders every KV read (always zeros here)
    outputs       logits [B, n, V] or hidden_states_out [B, S, H]
    state         past_key_{i}, past_value_{i} [B, KV, T, D] f32 per layer i of the stage

cos/sin and the attention bias are computed once per stage and shared by its layers.
``weights`` turns checkpoint tensor names into weight subgraphs (:class:`WeightSource`); the
quantisation mode lives there, never here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import openvino as ov
import openvino.opset13 as ops

from engine.shards.tensor_names import (
    ATTENTION_MASK,
    BEAM_IDX,
    INPUT_IDS,
    INPUTS_EMBEDS,
    LOGITS_LAST,
    POSITION_IDS,
    past_key,
    past_value,
    stage_output,
)
from export.builder import ops as blocks
from export.builder.families import ModelShape
from export.builder.rope import inverse_frequencies


class WeightSource(Protocol):
    """What the builder asks of a stage's weights (export.weights.stage_weights.StageWeights)."""

    def linear(self, name: str) -> ov.Output: ...  # f32 [out, in]
    def embedding(self, name: str) -> ov.Output: ...  # f32 [vocab, hidden]
    def vector(self, name: str) -> ov.Output: ...  # f32 [n]
    def stacked(self, names: list[str]) -> ov.Output: ...  # f32 [len(names), out, in]


@dataclass(frozen=True)
class StagePlan:
    """Which part of the model one stage holds (layers first..last inclusive)."""

    index: int
    first_layer: int
    last_layer: int
    has_embedding: bool
    has_head: bool

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)


def parameter(name: str, shape: list[int], dtype: ov.Type) -> ov.Node:
    param = ops.parameter(ov.PartialShape(shape), dtype, name=name)
    param.output(0).get_tensor().set_names({name})
    return param


def rotary_tables(shape: ModelShape, position_ids: ov.Output) -> tuple[ov.Output, ov.Output]:
    tables = inverse_frequencies(shape.rope, shape.head_dim, shape.max_positions)
    inv = blocks.const(tables.inv_freq)
    if tables.long_inv_freq is not None and tables.switch_at is not None:  # both or neither
        # longrope: the long factors once the sequence (max position + 1) outgrows the original window
        longest = ops.reduce_max(position_ids, blocks.i64([0, 1]), keep_dims=False)
        is_long = ops.greater(longest, blocks.i64(tables.switch_at - 1))
        inv = ops.select(is_long, blocks.const(tables.long_inv_freq), inv).output(0)
    return blocks.rotary_cos_sin(position_ids, inv, tables.scaling)


class LayerNames:
    """Names of one decoder layer's tensors, resolved once."""

    def __init__(self, shape: ModelShape, index: int):
        f = shape.family
        self.index = index
        self.prefix = f.layer_prefix.format(i=index)

    def __call__(self, name: str) -> str:
        return self.prefix + name


def project_qkv(shape: ModelShape, w: WeightSource, n: LayerNames, x: ov.Output, cos: ov.Output,
                sin: ov.Output) -> tuple[ov.Output, ov.Output, ov.Output]:
    """q [B, H, S, D], k and v [B, KV, S, D] of one layer: projections, q/k norms, rotary."""
    f, d = shape.family, shape.head_dim
    q_width, kv_width = shape.heads * d, shape.kv_heads * d
    if f.fused_qkv is not None:
        qkv = blocks.linear(x, w.linear(n(f.fused_qkv + ".weight")))
        parts = ops.variadic_split(qkv, blocks.i64(-1), blocks.i64([q_width, kv_width, kv_width]))
        q, k, v = parts.output(0), parts.output(1), parts.output(2)
    else:
        def proj(name: str) -> ov.Output:
            b = w.vector(n(name + ".bias")) if shape.qkv_bias else None
            return blocks.linear(x, w.linear(n(name + ".weight")), b)

        q, k, v = proj(f.q), proj(f.k), proj(f.v)
    q = blocks.split_heads(q, shape.heads, d)  # [B, S, H, D]
    k = blocks.split_heads(k, shape.kv_heads, d)
    v = blocks.split_heads(v, shape.kv_heads, d)
    if f.q_norm is not None and f.k_norm is not None:  # both or neither
        q = blocks.rms_norm(q, w.vector(n(f.q_norm)), shape.eps)
        k = blocks.rms_norm(k, w.vector(n(f.k_norm)), shape.eps)
    q = blocks.rotary(blocks.to_bhsd(q), cos, sin, d)  # [B, H, S, D]
    k = blocks.rotary(blocks.to_bhsd(k), cos, sin, d)  # [B, KV, S, D]
    return q, k, blocks.to_bhsd(v)


# (layer index, q [B, H, S, D], k, v [B, KV, S, D]) -> attention output [B, H, S, D]: how a
# stage graph keeps its cache (device state here, host ports in export.builder.static_stage).
Attend = Callable[[int, ov.Output, ov.Output, ov.Output], ov.Output]


def _stateful_attend(shape: ModelShape, bias: ov.Output, beam_idx: ov.Output | None, sinks: list) -> Attend:
    d = shape.head_dim

    def attend(layer: int, q: ov.Output, k: ov.Output, v: ov.Output) -> ov.Output:
        k_all, k_sink = blocks.kv_state(past_key(layer), k, shape.kv_heads, d, beam_idx)
        v_all, v_sink = blocks.kv_state(past_value(layer), v, shape.kv_heads, d, beam_idx)
        sinks.extend((k_sink, v_sink))
        k_all = blocks.expand_groups(k_all, shape.groups, shape.heads, d)  # [B, H, T, D]
        v_all = blocks.expand_groups(v_all, shape.groups, shape.heads, d)
        scale = blocks.const(1.0 / math.sqrt(d))
        return ops.scaled_dot_product_attention(q, k_all, v_all, bias, scale, causal=False).output(0)

    return attend


def mlp(shape: ModelShape, w: WeightSource, n: LayerNames, x: ov.Output) -> ov.Output:
    f = shape.family

    def b(name: str) -> ov.Output | None:
        return w.vector(n(name + ".bias")) if shape.mlp_bias else None

    if f.fused_gate_up is not None:
        both = blocks.linear(x, w.linear(n(f.fused_gate_up + ".weight")))
        parts = ops.variadic_split(both, blocks.i64(-1), blocks.i64([shape.intermediate, shape.intermediate]))
        gate, up = parts.output(0), parts.output(1)
    else:
        gate = blocks.linear(x, w.linear(n(f.gate + ".weight")), b(f.gate))
        up = blocks.linear(x, w.linear(n(f.up + ".weight")), b(f.up))
    act = ops.multiply(ops.swish(gate), up)
    return blocks.linear(act.output(0), w.linear(n(f.down + ".weight")), b(f.down))


def expert_names(shape: ModelShape, n: LayerNames) -> tuple[list[str], list[str], list[str]]:
    """A MoE layer's gate, up and down matrices, one per expert in expert order."""
    m = shape.family.moe
    assert m is not None and shape.moe is not None
    every = range(shape.moe.experts)
    return ([n(m.gate.format(e=e)) for e in every], [n(m.up.format(e=e)) for e in every],
            [n(m.down.format(e=e)) for e in every])


def sparse_moe(shape: ModelShape, w: WeightSource, n: LayerNames, x: ov.Output) -> ov.Output:
    m, moe = shape.family.moe, shape.moe
    assert m is not None and moe is not None
    gate, up, down = expert_names(shape, n)
    return blocks.moe_block(x, w.linear(n(m.router)), w.stacked(gate), w.stacked(up), w.stacked(down),
                            moe.per_token, moe.normalise)


def head_tensor(shape: ModelShape, available: frozenset[str]) -> str:
    """The LM head's tensor: its own, or the embedding when tied (HF drops a tied head on save)."""
    f = shape.family
    return f.head if f.head in available and not shape.tied else f.embed


def decoder_layers(shape: ModelShape, stage: StagePlan, weights: WeightSource, h: ov.Output, cos: ov.Output,
                   sin: ov.Output, attend: Attend) -> ov.Output:
    """h [B, S, hidden] through the stage's decoder layers; ``attend`` keeps each layer's cache."""
    f = shape.family
    q_width = shape.heads * shape.head_dim
    for i in stage.layers:
        n = LayerNames(shape, i)
        x = blocks.rms_norm(h, weights.vector(n(f.input_norm)), shape.eps)
        q, k, v = project_qkv(shape, weights, n, x, cos, sin)
        o_bias = weights.vector(n(f.o + ".bias")) if shape.o_bias else None
        attended = blocks.linear(blocks.merge_heads(attend(i, q, k, v), q_width), weights.linear(n(f.o + ".weight")),
                                 o_bias)
        h = ops.add(h, attended).output(0)
        x = blocks.rms_norm(h, weights.vector(n(f.post_attn_norm)), shape.eps)
        ffn = sparse_moe if shape.is_moe_layer(i) else mlp
        h = ops.add(h, ffn(shape, weights, n, x)).output(0)
    return h


def final_logits(shape: ModelShape, weights: WeightSource, head: str, h: ov.Output) -> ov.Output:
    """The final norm and the LM head: h [B, n, hidden] -> logits [B, n, V]."""
    h = blocks.rms_norm(h, weights.vector(shape.family.final_norm), shape.eps)
    return blocks.linear(h, weights.linear(head))


def build_stage_model(shape: ModelShape, stage: StagePlan, weights: WeightSource, head: str,
                      beam_idx: bool = True) -> ov.Model:
    """The stage's stateful graph (see the module docstring); ``head`` from :func:`head_tensor`."""
    f = shape.family
    if stage.has_embedding:
        first = parameter(INPUT_IDS, [-1, -1], ov.Type.i64)
        h = ops.gather(weights.embedding(f.embed), first, blocks.i64(0)).output(0)  # [B, S, H]
    else:
        first = parameter(INPUTS_EMBEDS, [-1, -1, shape.hidden], ov.Type.f32)
        h = first.output(0)
    mask = parameter(ATTENTION_MASK, [-1, -1], ov.Type.i64)
    positions = parameter(POSITION_IDS, [-1, -1], ov.Type.i64)
    params = [first, mask, positions]
    logits_last = None
    if stage.has_head:
        logits_last = parameter(LOGITS_LAST, [], ov.Type.i64)
        params.append(logits_last)
    beam = parameter(BEAM_IDX, [-1], ov.Type.i32) if beam_idx else None

    cos, sin = rotary_tables(shape, positions.output(0))
    bias = blocks.attention_bias(mask.output(0), positions.output(0))
    sinks: list = []
    h = decoder_layers(shape, stage, weights, h, cos, sin,
                       _stateful_attend(shape, bias, beam.output(0) if beam else None, sinks))
    if logits_last is not None:  # the stage has the head
        h = blocks.trailing_rows(h, logits_last.output(0))
        out = final_logits(shape, weights, head, h)
    else:
        out = h
    result = ops.result(out)
    result.output(0).get_tensor().set_names({stage_output(logits_last is not None)})
    if beam is not None:
        params.append(beam)
    model = ov.Model([result], sinks, params, f"deskfleet_stage_{stage.index}")
    model.validate_nodes_and_infer_types()
    return model


def stage_tensor_names(shape: ModelShape, stage: StagePlan, available: frozenset[str]) -> list[str]:
    """Exactly the checkpoint tensors :func:`build_stage_model` reads for ``stage``."""
    f = shape.family
    names: list[str] = [f.embed] if stage.has_embedding else []
    for i in stage.layers:
        n = LayerNames(shape, i)
        names += [n(f.input_norm), n(f.post_attn_norm), n(f.o + ".weight")]
        if f.fused_qkv is not None:
            names.append(n(f.fused_qkv + ".weight"))
        else:
            names += [n(p + ".weight") for p in (f.q, f.k, f.v)]
            names += [n(p + ".bias") for p in (f.q, f.k, f.v)] if shape.qkv_bias else []
        if f.q_norm is not None and f.k_norm is not None:
            names += [n(f.q_norm), n(f.k_norm)]
        names += [n(f.o + ".bias")] if shape.o_bias else []
        if shape.is_moe_layer(i) and f.moe is not None:
            names.append(n(f.moe.router))
            for group in expert_names(shape, n):
                names += group
            continue
        names.append(n(f.down + ".weight"))
        if f.fused_gate_up is not None:
            names.append(n(f.fused_gate_up + ".weight"))
        else:
            names += [n(f.gate + ".weight"), n(f.up + ".weight")]
        names += [n(p + ".bias") for p in (f.gate, f.up, f.down)] if shape.mlp_bias and f.fused_gate_up is None else []
    if stage.has_head:
        names += [f.final_norm, head_tensor(shape, available)]
    return names
