"""What the graph builder needs to know about a checkpoint, read from its config.json dict alone.

One :class:`Family` row per ``model_type`` says where the tensors are and which optional parts
the decoder has (qkv bias, per-head q/k RMSNorm, fused projections, sparse MoE blocks). :class:`ModelShape` is the
config parsed once into a frozen object, so the graph code never looks into the raw dict.
No transformers here: the builder must run with openvino + numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import DeskfleetError
from export.builder.gemma4_shape import Gemma4ConfigError, Gemma4Shape, gemma4_shape
from export.builder.refused import refusal


class UnsupportedModelError(DeskfleetError):
    """The checkpoint's architecture, rope type or an option of its config is not one the builder handles."""


@dataclass(frozen=True)
class MoeNames:
    """Tensor names of a sparse mixture-of-experts block (relative to ``model.layers.{i}.``): a router
    [experts, hidden] and per expert a SwiGLU MLP, ``{e}`` the expert's index."""

    router: str = "mlp.gate.weight"
    gate: str = "mlp.experts.{e}.gate_proj.weight"
    up: str = "mlp.experts.{e}.up_proj.weight"
    down: str = "mlp.experts.{e}.down_proj.weight"


@dataclass(frozen=True)
class MoeShape:
    """A MoE config: which layers are sparse, how many experts, how many each token uses."""

    experts: int
    per_token: int  # top-k
    intermediate: int  # each expert's MLP width
    normalise: bool  # renormalise the top-k probabilities to sum to 1 (``norm_topk_prob``)
    layers: frozenset[int]


@dataclass(frozen=True)
class Family:
    """Tensor names (relative to ``model.layers.{i}.``) and optional parts of one decoder family."""

    model_type: str
    title: str
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    head: str = "lm_head.weight"
    layer_prefix: str = "model.layers.{i}."
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    input_norm: str = "input_layernorm.weight"
    post_attn_norm: str = "post_attention_layernorm.weight"
    q_norm: str | None = None  # per-head RMSNorm over head_dim before rotary (Qwen3)
    k_norm: str | None = None
    fused_qkv: str | None = None  # one [(H + 2 KV) * D, hidden] projection (Phi-3)
    fused_gate_up: str | None = None  # one [2 I, hidden] projection, gate rows first (Phi-3)
    qkv_bias: bool | None = None  # None: the config's ``attention_bias`` decides
    moe: MoeNames | None = None  # sparse MoE blocks in place of the MLP on the config's MoE layers
    gemma4: bool = False  # Gemma 4's layer (export.builder.gemma4_graph) in place of the Llama-like one

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError(f"{self.model_type}: q_norm and k_norm come together")


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "Llama (Llama 2/3/3.x, SmolLM2, TinyLlama)"),
    "mistral": Family("mistral", "Mistral", qkv_bias=False),
    "qwen2": Family("qwen2", "Qwen2 / Qwen2.5", qkv_bias=True),
    "qwen3": Family("qwen3", "Qwen3 (dense)", q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight"),
    "phi3": Family("phi3", "Phi-3 / Phi-3.5 mini", fused_qkv="self_attn.qkv_proj",
                   fused_gate_up="mlp.gate_up_proj", qkv_bias=False),
    "qwen3_moe": Family("qwen3_moe", "Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B)", q_norm="self_attn.q_norm.weight",
                        k_norm="self_attn.k_norm.weight", moe=MoeNames()),
    "gemma4_text": Family("gemma4_text", "Gemma 4 text (E2B, E4B, 31B, 26B-A4B MoE)",
                          q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight", qkv_bias=False,
                          gemma4=True),
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# ``rope_parameters["freq_factors"]``: per-frequency divisors from a GGUF's rope_freqs tensor
# (export.weights.gguf_source), on top of one of these types (as llama.cpp applies them).
ROPE_TYPES_WITH_FACTORS = ("default", "linear", "yarn")


def supported_summary() -> str:
    return ", ".join(f"{k} ({v.title})" for k, v in sorted(FAMILIES.items()))


@dataclass(frozen=True)
class ModelShape:
    """The decoder's dimensions and options, validated."""

    family: Family
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tied: bool
    rope: dict[str, Any]
    max_positions: int
    moe: MoeShape | None = None
    gemma4: Gemma4Shape | None = None  # the Gemma 4 family's per-layer facts

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    def kv_geometry(self, index: int) -> tuple[int, int]:
        """(KV heads, head_dim) of layer ``index`` (Gemma 4's full layers have their own)."""
        if self.gemma4 is not None:
            return self.gemma4.kv_heads[index], self.gemma4.head_dims[index]
        return self.kv_heads, self.head_dim

    @property
    def widest_kv(self) -> tuple[int, int]:
        """(KV heads, head_dim) of the layer with the most K values per position: a manifest's
        per-layer KV geometry, an upper bound for every layer's cache."""
        return max((self.kv_geometry(i) for i in range(self.num_layers)), key=lambda kd: kd[0] * kd[1])

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe.layers


def moe_shape(config: dict[str, Any], num_layers: int) -> MoeShape:
    """The MoE part of a Qwen3-MoE-style config: as HF's decoder layer decides, layer i is sparse
    unless it is in ``mlp_only_layers``, when ``(i + 1) % decoder_sparse_step == 0``."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    per_token = int(config.get("num_experts_per_tok") or 0)
    step = int(config.get("decoder_sparse_step", 1) or 1)
    dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    if experts <= 0 or not 0 < per_token <= experts:
        raise UnsupportedModelError(f"a MoE config needs 0 < num_experts_per_tok ({per_token}) <= num_experts "
                                    f"({experts})")
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("this MoE config has a shared expert, which qwen3_moe's builder does not build")
    layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoeShape(experts=experts, per_token=per_token, intermediate=int(config["moe_intermediate_size"]),
                    normalise=bool(config.get("norm_topk_prob", False)), layers=layers)


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The config's rope settings as one dict (transformers 5 ``rope_parameters``, or the older
    ``rope_scaling`` + ``rope_theta`` keys)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(config.get("rope_scaling") or {})
        out.setdefault("rope_type", out.pop("type", "default"))
    out.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in config:
        out.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if out.get("rope_type") == "longrope":
        out.setdefault("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    return out


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Parse and check an HF config dict; raises :class:`UnsupportedModelError` with what is supported."""
    model_type = config.get("model_type")
    family = FAMILIES.get(str(model_type))
    if family is None and refusal(str(model_type)) is not None:
        raise UnsupportedModelError(f"{refusal(str(model_type))}; supported: {supported_summary()}")
    if model_type == "gemma4":  # a checkpoint's model_type only (a GGUF's gemma4 is refused as unread)
        raise UnsupportedModelError(
            "this is a multimodal Gemma 4 checkpoint (gemma4, Gemma4ForConditionalGeneration, tensors under "
            "model.language_model.); the builder exports Gemma 4's text model as a gemma4_text checkpoint "
            "(Gemma4ForCausalLM): save that first, or pick a text-only Gemma 4 checkpoint")
    if family is None:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported for export; supported: {supported_summary()}")
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        shape_args: dict[str, Any] = dict(  # ints, and eps a float
            num_layers=int(config["num_hidden_layers"]), hidden=hidden,
            intermediate=int(config["intermediate_size"]), heads=heads, kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads), vocab=int(config["vocab_size"]),
            eps=float(config.get("rms_norm_eps", 1e-6)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedModelError(f"the {model_type} config.json lacks or garbles {exc}; "
                                    "is the checkpoint complete?") from exc
    if heads % kv_heads:
        raise UnsupportedModelError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    if family.gemma4:
        try:
            gemma = gemma4_shape(config, shape_args["num_layers"], shape_args["head_dim"], kv_heads,
                                 shape_args["intermediate"])
        except (Gemma4ConfigError, KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"this {model_type} checkpoint: {exc}") from exc
        moe = MoeShape(experts=gemma.experts, per_token=gemma.top_k, intermediate=gemma.moe_intermediate,
                       normalise=True, layers=frozenset(range(shape_args["num_layers"]))) if gemma.experts else None
        return ModelShape(family=family, **shape_args, qkv_bias=False, o_bias=False, mlp_bias=False,
                          tied=bool(config.get("tie_word_embeddings", True)), rope={}, moe=moe,
                          max_positions=int(config.get("max_position_embeddings", 4096)), gemma4=gemma)
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"activation {act!r} of this {model_type} checkpoint is not supported (only silu)")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope.get('rope_type')!r} of this {model_type} checkpoint is not "
                                    f"supported; supported rope types: {', '.join(ROPE_TYPES)}")
    factors = rope.get("freq_factors")
    if factors is not None:
        if rope.get("rope_type", "default") not in ROPE_TYPES_WITH_FACTORS:
            raise UnsupportedModelError(f"rope frequency factors combine with {', '.join(ROPE_TYPES_WITH_FACTORS)} "
                                        f"rope only, not {rope.get('rope_type')!r}")
        if len(factors) != shape_args["head_dim"] // 2:
            raise UnsupportedModelError(f"{len(factors)} rope frequency factors for heads of {shape_args['head_dim']}; "
                                        f"expected {shape_args['head_dim'] // 2}")
    if float(rope.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise UnsupportedModelError(f"partial rotary (factor {rope['partial_rotary_factor']}) is not supported yet; "
                                    "the builder rotates the whole head (Phi-3/3.5 mini, not Phi-4-mini)")
    attention_bias = bool(config.get("attention_bias", False))
    try:
        moe = moe_shape(config, shape_args["num_layers"]) if family.moe is not None else None
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedModelError(f"the {model_type} config.json lacks or garbles {exc}") from exc
    return ModelShape(
        moe=moe,
        family=family, **shape_args,
        qkv_bias=family.qkv_bias if family.qkv_bias is not None else attention_bias,
        o_bias=attention_bias and family.qkv_bias is None,
        mlp_bias=bool(config.get("mlp_bias", False)),
        tied=bool(config.get("tie_word_embeddings", False)),
        rope=rope,
        max_positions=int(config.get("max_position_embeddings", 4096)),
    )
