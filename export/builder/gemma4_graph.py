"""One Gemma 4 (text) stage's stateful graph: the same interface as export.builder.stage_graph's,
with the Gemma 4 layer (see export.builder.gemma4_shape for the maths it follows).

Across a cut the activation carries more than the hidden state: a later stage's first input
``inputs_embeds`` and a stage's ``hidden_states_out`` are [B, S, H + extra], the hidden state
first, then the :func:`~export.builder.gemma4_shape.carried` blocks: the PLE inputs of every later
layer (stage 0 computes them all: they need the token ids and the main embedding) and, for a
layer whose K/V a later stage's layer reuses, the new positions' K and V (the paper's "shared
tensors transmitted as additional stage outputs/inputs", packed as columns so that the runtimes
and the wire carry them as they carry any activation).

A layer that reuses another's K/V keeps its own copy of them as its own state (``past_key_{i}``,
``past_value_{i}``, appended with the producer's new K/V at each step): every layer of a stage has
its cache, which is what the stateful runtime and the paged conversion expect, at the price of
the memory KV sharing would save. Sliding-window layers mask keys older than the window; the
model's ``deskfleet_sliding_window`` rt_info lists every attention's window in layer order (0 =
none) for the paged conversion, whose PagedAttention applies the window itself.
"""

from __future__ import annotations

import math

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.shards.tensor_names import (
    ATTENTION_MASK,
    BEAM_IDX,
    INPUT_IDS,
    INPUTS_EMBEDS,
    LOGITS_LAST,
    POSITION_IDS,
    SLIDING_WINDOW_RT_INFO,
    past_key,
    past_value,
    stage_output,
)
from export.builder import ops as blocks
from export.builder.families import ModelShape
from export.builder.gemma4_shape import Carried, Gemma4Shape, carried
from export.builder.rope import inverse_frequencies
from export.builder.stage_graph import LayerNames, StagePlan, WeightSource, parameter
from export.weights.expert_views import expert_name

PLE_TABLE = "model.embed_tokens_per_layer.weight"
PLE_PROJECTION = "model.per_layer_model_projection.weight"
PLE_NORM = "model.per_layer_projection_norm.weight"
# Per layer, relative to model.layers.{i}.
PRE_FFN_NORM = "pre_feedforward_layernorm.weight"
POST_FFN_NORM = "post_feedforward_layernorm.weight"
PLE_GATE = "per_layer_input_gate.weight"
PLE_PROJECT = "per_layer_projection.weight"
PLE_POST_NORM = "post_per_layer_input_norm.weight"
LAYER_SCALAR = "layer_scalar"
# The MoE block (enable_moe_block), relative to model.layers.{i}.; the experts as
# export.weights.expert_views shows them, one matrix per expert.
ROUTER = "router.proj.weight"
ROUTER_SCALE = "router.scale"
EXPERT_SCALE = "router.per_expert_scale"
PRE_MOE_NORM = "pre_feedforward_layernorm_2.weight"
POST_MLP_NORM = "post_feedforward_layernorm_1.weight"
POST_MOE_NORM = "post_feedforward_layernorm_2.weight"
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def _gemma(shape: ModelShape) -> Gemma4Shape:
    assert shape.gemma4 is not None
    return shape.gemma4


def activation_width(shape: ModelShape, last_layer: int) -> int:
    """Columns of the activation after layer ``last_layer``: the hidden state and what is carried."""
    return shape.hidden + sum(c.width for c in carried(_gemma(shape), last_layer))


def _gelu(x: ov.Output) -> ov.Output:
    return ops.gelu(x, approximation_mode="tanh").output(0)


def _scale(x: ov.Output, factor: float) -> ov.Output:
    return ops.multiply(x, blocks.const(np.float32(factor))).output(0)


def _per_layer_inputs(shape: ModelShape, w: WeightSource, ids: ov.Output, embeds: ov.Output) -> ov.Output:
    """PLE [B, S, layers, P]: (norm(proj(embeds) / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2)."""
    g = _gemma(shape)
    p, layers = g.ple_dim, shape.num_layers
    split = blocks.i64([0, 0, layers, p])
    tokens = _scale(ops.gather(w.embedding(PLE_TABLE), ids, blocks.i64(0)).output(0), math.sqrt(p))
    tokens = ops.reshape(tokens, split, special_zero=True).output(0)
    context = _scale(blocks.linear(embeds, w.linear(PLE_PROJECTION)), shape.hidden ** -0.5)
    context = ops.reshape(context, split, special_zero=True).output(0)
    context = blocks.rms_norm(context, w.vector(PLE_NORM), shape.eps)
    return _scale(ops.add(context, tokens).output(0), 2.0 ** -0.5)


def _flat_heads(x: ov.Output) -> ov.Output:
    """[B, N, S, D] -> [B, S, N * D] (a carried K or V)."""
    return ops.reshape(blocks.to_bhsd(x), blocks.i64([0, 0, -1]), special_zero=True).output(0)


def _unflat_heads(x: ov.Output, heads: int, d: int) -> ov.Output:
    return blocks.to_bhsd(blocks.split_heads(x, heads, d))


class _Stage:
    """The tensors one stage's layers share: rotary tables and masks per layer type, the PLE
    inputs and the K/V of producer layers (computed here or carried in)."""

    def __init__(self, shape: ModelShape, stage: StagePlan, w: WeightSource, mask: ov.Output, positions: ov.Output,
                 beam: ov.Output | None):
        self.shape, self.g, self.stage, self.w, self.beam = shape, _gemma(shape), stage, w, beam
        self.rotary: dict[str, tuple[ov.Output, ov.Output]] = {}
        self.bias: dict[str, ov.Output] = {}
        for kind in sorted({self.g.layer_types[i] for i in stage.layers}):
            layer = next(i for i in stage.layers if self.g.layer_types[i] == kind)
            tables = inverse_frequencies(self.g.rope[kind], self.g.head_dims[layer], shape.max_positions)
            self.rotary[kind] = blocks.rotary_cos_sin(positions, blocks.const(tables.inv_freq), tables.scaling)
            window = self.g.sliding_window if self.g.is_sliding(layer) else None
            self.bias[kind] = blocks.attention_bias(mask, positions, window)
        self.ple: dict[int, ov.Output] = {}
        self.kv: dict[int, tuple[ov.Output, ov.Output]] = {}  # producer layer -> new K, V [B, KV, S, D]
        self.sinks: list = []

    def take_carried(self, blocks_in: list[Carried], parts: list[ov.Output]) -> None:
        pending: dict[int, ov.Output] = {}
        for c, part in zip(blocks_in, parts, strict=True):
            if c.kind == "ple":
                self.ple[c.layer] = part
            else:
                d, heads = self.g.head_dims[c.layer], self.g.kv_heads[c.layer]
                tensor = _unflat_heads(part, heads, d)
                if c.kind == "key":
                    pending[c.layer] = tensor
                else:
                    self.kv[c.layer] = (pending.pop(c.layer), tensor)

    def give_carried(self, h: ov.Output) -> ov.Output:
        parts = [h]
        for c in carried(self.g, self.stage.last_layer):
            if c.kind == "ple":
                parts.append(self.ple[c.layer])
            else:
                parts.append(_flat_heads(self.kv[c.layer][0 if c.kind == "key" else 1]))
        return ops.concat(parts, axis=-1).output(0) if len(parts) > 1 else h

    def attention(self, i: int, n: LayerNames, x: ov.Output) -> ov.Output:
        g, shape, w = self.g, self.shape, self.w
        d, heads, kv_heads = g.head_dims[i], shape.heads, g.kv_heads[i]
        kind = g.layer_types[i]
        cos, sin = self.rotary[kind]
        q = blocks.split_heads(blocks.linear(x, w.linear(n("self_attn.q_proj.weight"))), heads, d)
        q = blocks.rms_norm(q, w.vector(n("self_attn.q_norm.weight")), shape.eps)
        q = blocks.rotary(blocks.to_bhsd(q), cos, sin, d)
        if g.shares_kv(i):
            k, v = self.kv[g.kv_source[i]]
        else:
            raw_k = blocks.split_heads(blocks.linear(x, w.linear(n("self_attn.k_proj.weight"))), kv_heads, d)
            raw_v = raw_k if g.values_are_keys(i) else blocks.split_heads(
                blocks.linear(x, w.linear(n("self_attn.v_proj.weight"))), kv_heads, d)
            k = blocks.rms_norm(raw_k, w.vector(n("self_attn.k_norm.weight")), shape.eps)
            k = blocks.rotary(blocks.to_bhsd(k), cos, sin, d)
            v = blocks.to_bhsd(blocks.rms_norm(raw_v, blocks.const(np.ones(d, np.float32)), shape.eps))
            self.kv[i] = (k, v)
        k_all, k_sink = blocks.kv_state(past_key(i), k, kv_heads, d, self.beam)
        v_all, v_sink = blocks.kv_state(past_value(i), v, kv_heads, d, self.beam)
        self.sinks += [k_sink, v_sink]
        k_all = blocks.expand_groups(k_all, heads // kv_heads, heads, d)
        v_all = blocks.expand_groups(v_all, heads // kv_heads, heads, d)
        out = ops.scaled_dot_product_attention(q, k_all, v_all, self.bias[kind], blocks.const(1.0), causal=False)
        return blocks.linear(blocks.merge_heads(out.output(0), heads * d), w.linear(n("self_attn.o_proj.weight")))

    def moe(self, n: LayerNames, residual: ov.Output) -> ov.Output:
        """The MoE block over the layer's residual [B, S, H], as HF's Gemma4TextRouter and experts."""
        g, shape, w = self.g, self.shape, self.w
        flat = ops.reshape(residual, blocks.i64([-1, shape.hidden]), special_zero=False).output(0)  # [T, H]
        routed = blocks.rms_norm(flat, blocks.const(np.ones(shape.hidden, np.float32)), shape.eps)
        routed = _scale(ops.multiply(routed, w.vector(n(ROUTER_SCALE))).output(0), shape.hidden ** -0.5)
        probs = ops.softmax(blocks.linear(routed, w.linear(n(ROUTER))), -1)  # [T, E]
        top = ops.topk(probs, blocks.i64(g.top_k), axis=-1, mode="max", sort="value", index_element_type="i64")
        weights = ops.divide(top.output(0), ops.reduce_sum(top.output(0), blocks.i64([-1]), keep_dims=True))
        weights = ops.multiply(weights, ops.gather(w.vector(n(EXPERT_SCALE)), top.output(1), blocks.i64(0)))
        rows = blocks.rms_norm(flat, w.vector(n(PRE_MOE_NORM)), shape.eps)
        gate, up, down = (w.stacked(names) for names in _expert_names(g, n))
        out = blocks.moe_experts(rows, weights.output(0), top.output(1), gate, up, down, g.top_k, _gelu)
        return ops.reshape(out, ops.shape_of(residual), special_zero=False).output(0)

    def layer(self, i: int, h: ov.Output) -> ov.Output:
        shape, w, eps = self.shape, self.w, self.shape.eps
        n = LayerNames(shape, i)
        x = blocks.rms_norm(h, w.vector(n("input_layernorm.weight")), eps)
        attended = blocks.rms_norm(self.attention(i, n, x), w.vector(n("post_attention_layernorm.weight")), eps)
        h = ops.add(h, attended).output(0)
        x = blocks.rms_norm(h, w.vector(n(PRE_FFN_NORM)), eps)
        gate = _gelu(blocks.linear(x, w.linear(n("mlp.gate_proj.weight"))))
        up = blocks.linear(x, w.linear(n("mlp.up_proj.weight")))
        ffn = blocks.linear(ops.multiply(gate, up).output(0), w.linear(n("mlp.down_proj.weight")))
        if self.g.experts:
            dense = blocks.rms_norm(ffn, w.vector(n(POST_MLP_NORM)), eps)
            ffn = ops.add(dense, blocks.rms_norm(self.moe(n, h), w.vector(n(POST_MOE_NORM)), eps)).output(0)
        h = ops.add(h, blocks.rms_norm(ffn, w.vector(n(POST_FFN_NORM)), eps)).output(0)
        if self.g.ple_dim:
            gated = ops.multiply(_gelu(blocks.linear(h, w.linear(n(PLE_GATE)))), self.ple[i]).output(0)
            projected = blocks.linear(gated, w.linear(n(PLE_PROJECT)))
            h = ops.add(h, blocks.rms_norm(projected, w.vector(n(PLE_POST_NORM)), eps)).output(0)
        return ops.multiply(h, w.vector(n(LAYER_SCALAR))).output(0)


def build_gemma4_stage(shape: ModelShape, stage: StagePlan, weights: WeightSource, head: str,
                       beam_idx: bool = True) -> ov.Model:
    """The stage's stateful graph (export.builder.stage_graph's interface; see the module docstring)."""
    g = _gemma(shape)
    if stage.has_embedding:
        first = parameter(INPUT_IDS, [-1, -1], ov.Type.i64)
        h = _scale(ops.gather(weights.embedding(shape.family.embed), first, blocks.i64(0)).output(0),
                   math.sqrt(shape.hidden))
    else:
        first = parameter(INPUTS_EMBEDS, [-1, -1, activation_width(shape, stage.first_layer - 1)], ov.Type.f32)
        h = first.output(0)
    mask = parameter(ATTENTION_MASK, [-1, -1], ov.Type.i64)
    positions = parameter(POSITION_IDS, [-1, -1], ov.Type.i64)
    params = [first, mask, positions]
    logits_last = parameter(LOGITS_LAST, [], ov.Type.i64) if stage.has_head else None
    params += [logits_last] if logits_last is not None else []
    beam = parameter(BEAM_IDX, [-1], ov.Type.i32) if beam_idx else None
    s = _Stage(shape, stage, weights, mask.output(0), positions.output(0), beam.output(0) if beam else None)
    if stage.has_embedding:
        if g.ple_dim:
            ple = _per_layer_inputs(shape, weights, first.output(0), h)
            for i in range(shape.num_layers):
                s.ple[i] = ops.gather(ple, blocks.i64(i), blocks.i64(2)).output(0)  # [B, S, P]
    else:
        incoming = list(carried(g, stage.first_layer - 1))
        widths = [shape.hidden] + [c.width for c in incoming]
        parts = ops.variadic_split(h, blocks.i64(-1), blocks.i64(widths))
        h = parts.output(0)
        s.take_carried(incoming, [parts.output(k + 1) for k in range(len(incoming))])
    for i in stage.layers:
        h = s.layer(i, h)
    if logits_last is not None:
        h = blocks.trailing_rows(h, logits_last.output(0))
        h = blocks.rms_norm(h, weights.vector(shape.family.final_norm), shape.eps)
        out = blocks.linear(h, weights.linear(head))
        if g.softcap is not None:
            cap = blocks.const(np.float32(g.softcap))
            out = ops.multiply(ops.tanh(ops.divide(out, cap)), cap).output(0)
    else:
        out = s.give_carried(h)
    result = ops.result(out)
    result.output(0).get_tensor().set_names({stage_output(logits_last is not None)})
    if beam is not None:
        params.append(beam)
    model = ov.Model([result], s.sinks, params, f"deskfleet_stage_{stage.index}")
    model.set_rt_info(",".join(str(g.sliding_window if g.is_sliding(i) else 0) for i in stage.layers),
                      SLIDING_WINDOW_RT_INFO)
    model.validate_nodes_and_infer_types()
    return model


def _expert_names(g: Gemma4Shape, n: LayerNames) -> list[list[str]]:
    """A MoE layer's gate, up and down matrices, one per expert in expert order."""
    return [[n(expert_name("", e, part)) for e in range(g.experts)] for part in EXPERT_PARTS]


def gemma4_tensor_names(shape: ModelShape, stage: StagePlan, head: str) -> list[str]:
    """Exactly the checkpoint tensors :func:`build_gemma4_stage` reads for ``stage``."""
    g = _gemma(shape)
    f = shape.family
    names: list[str] = []
    if stage.has_embedding:
        names.append(f.embed)
        names += [PLE_TABLE, PLE_PROJECTION, PLE_NORM] if g.ple_dim else []
    for i in stage.layers:
        n = LayerNames(shape, i)
        names += [n(x) for x in ("input_layernorm.weight", "post_attention_layernorm.weight", PRE_FFN_NORM,
                                 POST_FFN_NORM, "self_attn.q_proj.weight", "self_attn.q_norm.weight",
                                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight", LAYER_SCALAR)]
        if not g.shares_kv(i):
            names += [n("self_attn.k_proj.weight"), n("self_attn.k_norm.weight")]
            names += [] if g.values_are_keys(i) else [n("self_attn.v_proj.weight")]
        names += [n(PLE_GATE), n(PLE_PROJECT), n(PLE_POST_NORM)] if g.ple_dim else []
        if g.experts:
            names += [n(x) for x in (ROUTER, ROUTER_SCALE, EXPERT_SCALE, PRE_MOE_NORM, POST_MLP_NORM, POST_MOE_NORM)]
            names += [name for group in _expert_names(g, n) for name in group]
    if stage.has_head:
        names += [f.final_norm, head]
    return names
