"""Decoder building blocks in the exact op forms the CPU/GPU plugins fuse.

Each block is written for one fusion pass of the OpenVINO plugins (checked by
tests/test_builder_runtime.py on the CPU's runtime model):

* :func:`rms_norm`: Power(x, 2) -> ReduceMean(-1, keep) -> Add(eps) -> Sqrt -> Divide(1, .)
  -> Multiply(x, .) -> Multiply(gamma), gamma an f32 constant (the RMS fusion).
* :func:`rotary`: rank-4 rotate-half, VariadicSplit on axis 3 and ``Concat([-x2, x1], -1)``
  (RoPE fusion; a Transpose right before it is folded into the fused op).
* :func:`kv_state`: ReadValue (zero-length initialiser [1, KV, 0, D]) -> Gather(beam_idx, 0)
  -> Concat(axis 2) -> Assign; the Concat has exactly two consumers, the Assign and the
  attention (or the GQA Unsqueeze), which the stateful-SDPA fusion insists on.
* :func:`expand_groups`: grouped-query K/V through Unsqueeze -> Broadcast(bidirectional)
  -> Reshape, the form the same fusion accepts for GQA.

* :func:`moe_block`: the experts as three GroupedMatMuls (opset17) over the token rows sorted by
  expert, which the CPU plugin's ConvertGroupedMatMulToGatherMatmul lowers to its GatherMatmul
  MoE kernel (only the routed experts' weights are read). The "tiled" form OpenVINO's
  ConvertTiledMoeBlockTo3GatherMatmuls matches (Tile -> batched MatMuls over all experts ->
  weighted ReduceSum) is not lowered by this CPU build, not even on OpenVINO's own test graph.

Shapes in comments: B batch, S new positions, T = P + S visible positions, H query heads,
KV key/value heads, D head_dim.
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.op import assign as Assign
from openvino.op import read_value as ReadValue
from openvino.op.util import Variable, VariableInfo
from openvino.opset17 import grouped_matmul

Out: TypeAlias = ov.Output


def const(value, dtype=np.float32) -> Out:
    return ops.constant(np.asarray(value, dtype=dtype)).output(0)


def i64(values) -> Out:
    return const(values, np.int64)


def rms_norm(x: Out, gamma: Out, eps: float) -> Out:
    """x * rsqrt(mean(x^2, -1) + eps) * gamma over the last axis."""
    square = ops.power(x, const(2.0))
    mean = ops.reduce_mean(square, i64([-1]), keep_dims=True)
    root = ops.sqrt(ops.add(mean, const(eps)))
    normed = ops.multiply(x, ops.divide(const(1.0), root))
    return ops.multiply(gamma, normed).output(0)


def linear(x: Out, weight: Out, bias: Out | None = None) -> Out:
    """x [.., in] @ weight[out, in]^T (+ bias)."""
    y = ops.matmul(x, weight, transpose_a=False, transpose_b=True)
    return (ops.add(y, bias) if bias is not None else y).output(0)


def split_heads(x: Out, heads: int, head_dim: int) -> Out:
    """[B, S, heads * D] -> [B, S, heads, D] (before the per-head norm and the transpose)."""
    return ops.reshape(x, i64([0, 0, heads, head_dim]), special_zero=True).output(0)


def to_bhsd(x: Out) -> Out:
    """[B, S, N, D] -> [B, N, S, D]."""
    return ops.transpose(x, i64([0, 2, 1, 3])).output(0)


def merge_heads(x: Out, width: int) -> Out:
    """Attention output [B, H, S, D] -> [B, S, H * D]."""
    return ops.reshape(to_bhsd(x), i64([0, 0, width]), special_zero=True).output(0)


def rotary_cos_sin(position_ids: Out, inv_freq: Out, scaling: float) -> tuple[Out, Out]:
    """cos, sin [B, 1, S, D] from position_ids [B, S] i64 and inv_freq [D / 2]: once per stage."""
    pos = ops.unsqueeze(ops.convert(position_ids, ov.Type.f32), i64([2]))  # [B, S, 1]
    freqs = ops.multiply(pos, inv_freq)  # [B, S, D / 2]
    emb = ops.concat([freqs, freqs], axis=-1)  # [B, S, D]
    cos, sin = ops.cos(emb), ops.sin(emb)
    if scaling != 1.0:
        cos, sin = ops.multiply(cos, const(scaling)), ops.multiply(sin, const(scaling))
    axis = i64([1])
    return ops.unsqueeze(cos, axis).output(0), ops.unsqueeze(sin, axis).output(0)


def rotary(x: Out, cos: Out, sin: Out, head_dim: int) -> Out:
    """x [B, N, S, D] rotated: x * cos + rotate_half(x) * sin, rotate_half = [-x2, x1]."""
    half = head_dim // 2
    parts = ops.variadic_split(x, i64(3), i64([half, half]))
    x1, x2 = parts.output(0), parts.output(1)
    rotated = ops.concat([ops.multiply(x2, const(-1.0)), x1], axis=-1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin)).output(0)


def kv_state(name: str, current: Out, kv_heads: int, head_dim: int, beam_idx: Out | None) -> tuple[Out, ov.Node]:
    """The cache of one K or V: returns (past + current [B, KV, T, D], its Assign sink)."""
    info = VariableInfo()
    info.variable_id = name
    info.data_shape = ov.PartialShape([-1, kv_heads, -1, head_dim])
    info.data_type = ov.Type.f32
    variable = Variable(info)
    init = ops.constant(np.zeros((1, kv_heads, 0, head_dim), dtype=np.float32))
    read = ReadValue(init.output(0), variable)
    past = ops.gather(read, beam_idx, i64(0)) if beam_idx is not None else read
    both = ops.concat([past, current], axis=2)
    return both.output(0), Assign(both, variable)


def expand_groups(kv: Out, groups: int, heads: int, head_dim: int) -> Out:
    """[B, KV, T, D] -> [B, H, T, D], each KV head serving ``groups`` consecutive query heads."""
    if groups == 1:
        return kv
    wide = ops.unsqueeze(kv, i64([2]))  # [B, KV, 1, T, D]
    wide = ops.broadcast(wide, i64([1, 1, groups, 1, 1]), broadcast_spec="BIDIRECTIONAL")  # [B, KV, G, T, D]
    return ops.reshape(wide, i64([0, heads, -1, head_dim]), special_zero=True).output(0)


def attention_bias(attention_mask: Out, position_ids: Out, window: int | None = None) -> Out:
    """Additive mask [B, 1, S, T]: causal over physical positions, minus masked cache slots.

    attention_mask [B, T] i64 covers every physical cache position plus the S new ones (1 =
    attend); the i-th new token sits at physical position T - S + i. Masked slots get the
    lowest f32, not -inf, so that a fully masked row stays finite (as the static NPU graphs do).
    ``window``: a sliding window, each query seeing only the ``window`` positions up to its own.
    """
    total = ops.gather(ops.shape_of(attention_mask), i64(1), i64(0))  # T
    new = ops.gather(ops.shape_of(position_ids), i64(1), i64(0))  # S
    keys = ops.range(i64(0), total, i64(1), output_type="i64")  # [T]
    queries = ops.range(ops.subtract(total, new), total, i64(1), output_type="i64")  # [S]
    causal = ops.less_equal(ops.unsqueeze(keys, i64([0])), ops.unsqueeze(queries, i64([1])))  # [S, T]
    if window is not None:
        near = ops.greater(ops.unsqueeze(keys, i64([0])), ops.unsqueeze(ops.subtract(queries, i64(window)), i64([1])))
        causal = ops.logical_and(causal, near)
    visible = ops.greater(ops.unsqueeze(attention_mask, i64([1, 2])), i64(0))  # [B, 1, 1, T]
    allowed = ops.logical_and(ops.unsqueeze(causal, i64([0, 1])), visible)  # [B, 1, S, T]
    return ops.select(allowed, const(0.0), const(np.finfo(np.float32).min)).output(0)


def trailing_rows(h: Out, logits_last: Out) -> Out:
    """The last ``logits_last`` rows of h [B, S, H] (0 = all): only they go through the head.

    A Gather over Range(start, S) rather than a Slice: the CPU plugin lowers Slice to a
    StridedSlice, and the runtime graph is meant to have none.
    """
    seq = ops.gather(ops.shape_of(h), i64(1), i64(0))  # S
    n = ops.select(ops.greater(logits_last, i64(0)), logits_last, seq)
    start = ops.maximum(ops.subtract(seq, n), i64(0))
    rows = ops.range(start, seq, i64(1), output_type="i64")  # [n]
    return ops.gather(h, rows, i64(1)).output(0)



def moe_block(x: Out, router: Out, gate: Out, up: Out, down: Out, top_k: int, normalise: bool) -> Out:
    """Sparse MoE with SwiGLU experts, routed as HF's Qwen3-MoE: x [B, S, H] -> [B, S, H].

    router [E, H]; gate, up [E, I, H]; down [E, H, I]. Each token's router softmax (f32) picks its
    ``top_k`` experts (TopK sorted by value, as torch.topk), their probabilities renormalised to sum
    to one when ``normalise``; the output is the probability-weighted sum of those experts' MLPs
    (:func:`moe_experts`).
    """
    hidden = router.get_partial_shape()[1].get_length()
    flat = ops.reshape(x, i64([-1, hidden]), special_zero=False)  # [T, H], T = B * S
    probs = ops.softmax(ops.matmul(flat, router, transpose_a=False, transpose_b=True), -1)  # [T, E]
    top = ops.topk(probs, i64(top_k), axis=-1, mode="max", sort="value", index_element_type="i64")
    weights = top.output(0)  # [T, k]
    if normalise:
        weights = ops.divide(weights, ops.reduce_sum(weights, i64([-1]), keep_dims=True)).output(0)
    out = moe_experts(flat.output(0), weights, top.output(1), gate, up, down, top_k, ops.swish)
    return ops.reshape(out, ops.shape_of(x), special_zero=False).output(0)  # [B, S, H]


def moe_experts(flat: Out, weights: Out, chosen: Out, gate: Out, up: Out, down: Out, top_k: int,
                act=ops.swish) -> Out:
    """The routed experts' gated MLPs: rows flat [T, H], each token's ``top_k`` experts ``chosen``
    [T, k] i64 and their ``weights`` [T, k] -> [T, H], sum over k of weight * down(act(gate x) * up x).

    The T * k (token, expert) pairs are sorted by expert (a stable TopK), so each expert's rows are
    contiguous; three GroupedMatMuls with the cumulative row counts as offsets run every row
    through its own expert only (the CPU plugin lowers them to GatherMatmul: the picked experts'
    weights are the only ones read); the rows are then put back in pair order and each token's k
    rows summed with their weights.
    """
    experts = gate.get_partial_shape()[0].get_length()
    hidden = down.get_partial_shape()[1].get_length()
    chosen = ops.reshape(chosen, i64([-1]), special_zero=False)  # [T * k] expert of each pair
    pairs = ops.squeeze(ops.shape_of(chosen), i64([0]))  # T * k
    by_expert = ops.topk(chosen, pairs, axis=0, mode="min", sort="value", index_element_type="i64",
                         stable=True).output(1)  # [T * k] pair indices, grouped by expert
    rows = ops.gather(flat, ops.divide(by_expert, i64(top_k)), i64(0))  # [T * k, H]
    one_hot = ops.one_hot(chosen, i64(experts), i64(1), i64(0), axis=-1)  # [T * k, E]
    ends = ops.cumsum(ops.reduce_sum(one_hot, i64([0]), keep_dims=False), i64(0))  # [E] cumulative row counts
    act_rows = ops.multiply(act(grouped_matmul(rows, gate, ends)), grouped_matmul(rows, up, ends))  # [T * k, I]
    out = grouped_matmul(act_rows, down, ends)  # [T * k, H]
    pair_weight = ops.gather(ops.reshape(weights, i64([-1]), special_zero=False), by_expert, i64(0))
    out = ops.multiply(out, ops.unsqueeze(pair_weight, i64([1])))
    back = ops.topk(by_expert, pairs, axis=0, mode="min", sort="value", index_element_type="i64").output(1)
    out = ops.gather(out, back, i64(0))  # [T * k, H] in pair order: token-major, k per token
    return ops.reduce_sum(ops.reshape(out, i64([-1, top_k, hidden]), special_zero=False), i64([1]),
                          keep_dims=False).output(0)
