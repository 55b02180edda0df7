"""Gemma 4 (text) as the builder needs it, read from its config.json dict alone.

What sets Gemma 4 apart from the Llama-like families (transformers' ``modeling_gemma4``):

* two kinds of layer (``layer_types``): sliding-window attention (``sliding_window`` keys, the
  query's own included) and full attention, each with its own rope (``rope_parameters`` per
  type; full layers use ``proportional`` rope: only the first ``partial_rotary_factor`` of the
  frequencies turn), its own head_dim (``global_head_dim`` on full layers) and, with
  ``attention_k_eq_v``, one projection for keys and values on full layers
  (``num_global_key_value_heads`` heads);
* KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V; each reuses the K/V of the
  last earlier layer of its type (:attr:`Gemma4Shape.kv_source`);
* per-layer embeddings (PLE): a second token table [vocab, layers * P] and a projection of the
  main embedding, combined into a P-wide input for each layer;
* RMSNorms around attention and MLP (pre and post), GELU-tanh MLPs (double width on the shared
  layers with ``use_double_wide_mlp``), a per-layer scalar, embeddings scaled by sqrt(hidden),
  attention scale 1 (q and k are RMS-normed), logits soft-capped by ``final_logit_softcapping``;
* with ``enable_moe_block`` (26B-A4B) every layer adds a MoE block to its dense MLP: a router over
  the RMS-normed residual (scaled per channel and by 1/sqrt(hidden)), top-k of its softmax
  renormalised and scaled per expert, GELU-tanh experts stacked as ``experts.gate_up_proj``.

:func:`carried` says what a stage passes on besides the hidden state when a cut falls between
a layer and the PLE or K/V it needs (see export.builder.gemma4_graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
# Rope types a Gemma 4 layer type may name (the builder's rotary tables, export.builder.rope).
GEMMA4_ROPE_TYPES = ("default", "proportional", "linear")


class Gemma4ConfigError(ValueError):
    """A Gemma 4 option the builder does not build (raised as UnsupportedModelError by families)."""


@dataclass(frozen=True)
class Gemma4Shape:
    """Per-layer facts of a Gemma 4 text model, validated."""

    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    intermediates: tuple[int, ...]
    kv_source: tuple[int, ...]  # the layer whose K/V layer i attends to (i itself unless shared)
    sliding_window: int
    rope: dict[str, dict[str, Any]]  # per layer type
    ple_dim: int  # hidden_size_per_layer_input; 0 = no per-layer embeddings
    ple_vocab: int
    softcap: float | None
    k_eq_v: bool  # full layers: values are the key projection (before the key norm)
    experts: int = 0  # enable_moe_block: every layer's MoE block beside its dense MLP (0 = none)
    top_k: int = 0
    moe_intermediate: int = 0

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def shares_kv(self, layer: int) -> bool:
        return self.kv_source[layer] != layer

    def values_are_keys(self, layer: int) -> bool:
        return self.k_eq_v and not self.is_sliding(layer)


@dataclass(frozen=True)
class Carried:
    """One block of columns a stage passes on after the hidden state: a later layer's PLE input
    (``kind`` "ple") or the new positions' K or V of a layer whose K/V a later layer reuses
    (``kind`` "key"/"value", [heads * head_dim] per position, heads-major)."""

    kind: str
    layer: int
    width: int


def carried(g: Gemma4Shape, last_layer: int) -> tuple[Carried, ...]:
    """What the stage ending at ``last_layer`` passes on beside the hidden state, in column order:
    the PLE inputs of every later layer, then K and V of every layer up to ``last_layer`` whose
    K/V a layer after it reuses (the paper's "shared tensors as additional stage outputs")."""
    layers = len(g.layer_types)
    out: list[Carried] = []
    if g.ple_dim:
        out += [Carried("ple", i, g.ple_dim) for i in range(last_layer + 1, layers)]
    producers = sorted({g.kv_source[i] for i in range(last_layer + 1, layers) if g.kv_source[i] <= last_layer})
    for p in producers:
        width = g.kv_heads[p] * g.head_dims[p]
        out += [Carried("key", p, width), Carried("value", p, width)]
    return tuple(out)


def _kv_sources(types: list[str], shared: int) -> tuple[int, ...]:
    """As transformers' ``kv_sharing_modes``: layers from ``len - shared`` on reuse the K/V of the
    last earlier (non-shared) layer of their type."""
    n = len(types)
    first = n - shared
    if shared and first <= 0:
        raise Gemma4ConfigError(f"num_kv_shared_layers {shared} leaves no layer computing K/V")
    out = list(range(n))
    for i in range(first, n):
        producers = [j for j in range(first) if types[j] == types[i]]
        if not producers:
            raise Gemma4ConfigError(f"layer {i} ({types[i]}) shares K/V but no earlier layer of its type computes them")
        out[i] = producers[-1]
    return tuple(out)


def _per_layer(config: dict[str, Any], types: list[str], key: str, default: int, full_default: int) -> tuple[int, ...]:
    """``key`` of each layer: ``per_layer_config`` (what transformers writes) when present, else
    the global value for full layers and ``default`` for the others."""
    given = config.get("per_layer_config")
    out = []
    for i, kind in enumerate(types):
        if isinstance(given, dict):
            override = given.get(str(i)) or given.get(i) or {}
            out.append(int(override.get(key, default)))
        else:
            out.append(full_default if kind == FULL else default)
    return tuple(out)


def gemma4_shape(config: dict[str, Any], num_layers: int, head_dim: int, kv_heads: int,
                 intermediate: int) -> Gemma4Shape:
    """Parse the Gemma 4 part of a ``gemma4_text`` config; Gemma4ConfigError names what is not built."""
    experts = top_k = moe_intermediate = 0
    if config.get("enable_moe_block"):
        experts, top_k = int(config.get("num_experts") or 0), int(config.get("top_k_experts") or 0)
        moe_intermediate = int(config.get("moe_intermediate_size") or 0)
        if not 0 < top_k <= experts or moe_intermediate <= 0:
            raise Gemma4ConfigError(f"a MoE block needs 0 < top_k_experts ({top_k}) <= num_experts ({experts}) and "
                                    f"a moe_intermediate_size ({moe_intermediate})")
    if config.get("use_bidirectional_attention") == "all":
        raise Gemma4ConfigError("use_bidirectional_attention 'all' (an encoder) is not a causal decoder; not built")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise Gemma4ConfigError(f"activation {act!r} is not built for Gemma 4 (only gelu_pytorch_tanh)")
    if config.get("attention_bias"):
        raise Gemma4ConfigError("attention_bias is not built for Gemma 4 (no released model has it)")
    types = list(config.get("layer_types") or [])
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise Gemma4ConfigError(f"layer_types must name {num_layers} layers, each one of {', '.join(LAYER_TYPES)}")
    rope = config.get("rope_parameters") or {}
    for kind in set(types):
        params = rope.get(kind)
        if not isinstance(params, dict):
            raise Gemma4ConfigError(f"rope_parameters has no entry for {kind}")
        if params.get("rope_type", "default") not in GEMMA4_ROPE_TYPES:
            raise Gemma4ConfigError(f"rope type {params.get('rope_type')!r} of the {kind} layers is not built; "
                                    f"supported: {', '.join(GEMMA4_ROPE_TYPES)}")
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    global_kv = config.get("num_global_key_value_heads")
    head_dims = _per_layer(config, types, "head_dim", head_dim, int(config.get("global_head_dim") or head_dim))
    kv = _per_layer(config, types, "num_key_value_heads", kv_heads,
                    int(global_kv) if k_eq_v and global_kv else kv_heads)
    for kind in set(types):
        if len({head_dims[i] for i, t in enumerate(types) if t == kind}) != 1:
            raise Gemma4ConfigError(f"the {kind} layers have different head_dims; the builder shares one rotary "
                                    "table per layer type")
    shared = int(config.get("num_kv_shared_layers") or 0)
    sources = _kv_sources(types, shared)
    wide = bool(config.get("use_double_wide_mlp", False))
    intermediates = tuple(intermediate * (2 if wide and sources[i] != i else 1) for i in range(num_layers))
    softcap = config.get("final_logit_softcapping")
    ple = int(config.get("hidden_size_per_layer_input") or 0)
    return Gemma4Shape(
        layer_types=tuple(types), head_dims=head_dims, kv_heads=kv, intermediates=intermediates, kv_source=sources,
        sliding_window=int(config.get("sliding_window") or 0), rope={k: dict(v) for k, v in rope.items()},
        ple_dim=ple, ple_vocab=int(config.get("vocab_size_per_layer_input") or config["vocab_size"]),
        softcap=float(softcap) if softcap else None, k_eq_v=k_eq_v, experts=experts, top_k=top_k,
        moe_intermediate=moe_intermediate,
    )
