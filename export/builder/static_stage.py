"""One static, stateless NPU stage graph, built op by op (no torch): pinned shapes, host KV ports.

The NPU compiler accepts neither dynamic dimensions nor ReadValue/Assign state, so an NPU graph
is a pure function of fixed-shape tensors (paper §8.5), every shape known when it is built::

    input_ids       [1, S]  i64 (stage 0) or hidden_states [1, S, hidden] f32 (later stages)
    attention_mask  [1, W + S] i64          ("2d" graphs: one mask row shared by all S rows)
    attention_bias  [1, 1, S, W + S] f32     ("4d", the packed graph: 0 or f32 min per query row)
    position_ids    [1, S]  i64             true absolute positions, one per row
    past_key_{i}    [1, KV, W, D] f32       the host's KV ring for layer i, fed as it is
    -> logits [1, S, V] or hidden_states_out [1, S, hidden], new_key_{i}/new_value_{i} [1, KV, S, D]

W is the past window and S the graph's rows: 1 for decode, C for a prefill chunk, the slot count
for the packed graph (paper §8.6). The graph returns only the S new positions' K/V: the host
keeps the window, and copying all of it back every step would be pure waste. Every row of the
last stage gets logits (any row may be a slot's next token).

Attention runs over the whole fixed window every step, so K/V are not copied per query head:
each KV head's G query heads are folded into the row axis (head h = kv * G + g, row g * S + s)
and the [1, 1, S, T] bias comes with its rows repeated G times; 4-D throughout, like a prefill
(measured 4x cheaper attention on the CPU at T = 1024 than broadcasting K/V).
The projections, norms, rotary and MLP are the stateful builder's (:mod:`stage_graph`), and the
weights the same :class:`~export.builder.stage_graph.WeightSource`, so a static INT4 stage holds
exactly the values of the stateful INT4 stage of the same layers.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.shards.tensor_names import (
    ATTENTION_BIAS,
    ATTENTION_MASK,
    POSITION_IDS,
    first_input,
    new_key,
    new_value,
    past_key,
    past_kv_names,
    past_value,
    stage_output,
)
from export.builder import ops as blocks
from export.builder.families import ModelShape
from export.builder.stage_graph import StagePlan, WeightSource, decoder_layers, final_logits, parameter, rotary_tables

MASK_2D = ATTENTION_MASK
MASK_4D = ATTENTION_BIAS
MaskKind = Literal["2d", "4d"]


def static_input_names(stage: StagePlan, mask: MaskKind) -> list[str]:
    """The graph's inputs in order: first, mask, position_ids, then past key/value per layer."""
    first = first_input(stage.has_embedding, static=True)
    return [first, MASK_2D if mask == "2d" else MASK_4D, POSITION_IDS, *past_kv_names(stage.layers)]


def _bias_from_mask(mask: ov.Output, rows: int, window: int) -> ov.Output:
    """attention_mask [1, W + S] i64 -> additive bias [1, 1, S, W + S]: causal over physical
    positions (new row i sits at W + i), minus masked slots; f32 min rather than -inf keeps a
    fully masked row finite."""
    total = window + rows
    causal = np.arange(total)[None, :] <= (window + np.arange(rows))[:, None]  # [S, T]
    visible = ops.greater(ops.unsqueeze(mask, blocks.i64([1, 2])), blocks.i64(0))  # [1, 1, 1, T]
    allowed = ops.logical_and(ops.constant(causal[None, None]), visible)  # [1, 1, S, T]
    return ops.select(allowed, blocks.const(0.0), blocks.const(np.finfo(np.float32).min)).output(0)


def _repeat_rows(bias: ov.Output, groups: int, rows: int, total: int) -> ov.Output:
    """[1, 1, S, T] -> [1, 1, G * S, T], the rows repeated once per query head of a KV head."""
    if groups == 1:
        return bias
    wide = ops.unsqueeze(bias, blocks.i64([2]))  # [1, 1, 1, S, T]
    wide = ops.broadcast(wide, blocks.i64([1, 1, groups, rows, total]))  # [1, 1, G, S, T]
    return ops.reshape(wide, blocks.i64([1, 1, groups * rows, total]), special_zero=False).output(0)


def build_static_stage_model(shape: ModelShape, stage: StagePlan, weights: WeightSource, head: str, *,
                             rows: int, window: int, mask: MaskKind) -> ov.Model:
    """The stage's static graph with ``rows`` query rows over a ``window``-position past (see the
    module docstring); ``head`` from :func:`~export.builder.stage_graph.head_tensor`."""
    if rows < 1 or window < 1:
        raise ValueError(f"a static graph needs rows >= 1 and window >= 1, got {rows} and {window}")
    f, d, kv = shape.family, shape.head_dim, shape.kv_heads
    total, groups = window + rows, shape.groups
    names = static_input_names(stage, mask)
    if stage.has_embedding:
        first = parameter(names[0], [1, rows], ov.Type.i64)
        h = ops.gather(weights.embedding(f.embed), first, blocks.i64(0)).output(0)  # [1, S, hidden]
    else:
        first = parameter(names[0], [1, rows, shape.hidden], ov.Type.f32)
        h = first.output(0)
    if mask == "2d":
        mask_in = parameter(MASK_2D, [1, total], ov.Type.i64)
        bias = _bias_from_mask(mask_in.output(0), rows, window)
    else:
        mask_in = parameter(MASK_4D, [1, 1, rows, total], ov.Type.f32)
        bias = mask_in.output(0)
    bias = _repeat_rows(bias, groups, rows, total)  # [1, 1, G * S, T], shared by every layer
    positions = parameter(POSITION_IDS, [1, rows], ov.Type.i64)
    params = [first, mask_in, positions]
    cos, sin = rotary_tables(shape, positions.output(0))
    scale = blocks.const(1.0 / math.sqrt(d))
    new_kv: list[tuple[str, ov.Output]] = []

    def attend(layer: int, q: ov.Output, k: ov.Output, v: ov.Output) -> ov.Output:
        past_k = parameter(past_key(layer), [1, kv, window, d], ov.Type.f32)
        past_v = parameter(past_value(layer), [1, kv, window, d], ov.Type.f32)
        params.extend((past_k, past_v))
        new_kv.extend(((new_key(layer), k), (new_value(layer), v)))
        k_all = ops.concat([past_k, k], axis=2)  # [1, KV, T, D]
        v_all = ops.concat([past_v, v], axis=2)
        folded = ops.reshape(q, blocks.i64([1, kv, groups * rows, d]), special_zero=False)  # [1, KV, G*S, D]
        attn = ops.scaled_dot_product_attention(folded, k_all, v_all, bias, scale, causal=False)
        return ops.reshape(attn, blocks.i64([1, shape.heads, rows, d]), special_zero=False).output(0)  # [1, H, S, D]

    h = decoder_layers(shape, stage, weights, h, cos, sin, attend)
    if stage.has_head:
        out = final_logits(shape, weights, head, h)  # [1, S, V]
    else:
        out = h
    results = []
    for name, value in [(stage_output(stage.has_head), out), *new_kv]:
        result = ops.result(value)
        result.output(0).get_tensor().set_names({name})
        results.append(result)
    model = ov.Model(results, params, f"deskfleet_static_stage_{stage.index}_{rows}x{total}")
    model.validate_nodes_and_infer_types()
    return model
