"""What the graph builder needs to know about a checkpoint, read from its config.json dict alone.

One :class:`Family` row per ``model_type`` says where the tensors are and which optional parts
the decoder has (qkv bias, per-head q/k RMSNorm, fused projections). :class:`ModelShape` is the
config parsed once into a frozen object, so the graph code never looks into the raw dict.
No transformers here: the builder must run with openvino + numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import DeskfleetError


class UnsupportedModelError(DeskfleetError):
    """The checkpoint's architecture, rope type or an option of its config is not one the builder handles."""


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

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


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
    return ModelShape(
        family=family, **shape_args,
        qkv_bias=family.qkv_bias if family.qkv_bias is not None else attention_bias,
        o_bias=attention_bias and family.qkv_bias is None,
        mlp_bias=bool(config.get("mlp_bias", False)),
        tied=bool(config.get("tie_word_embeddings", False)),
        rope=rope,
        max_positions=int(config.get("max_position_embeddings", 4096)),
    )
