"""Per-architecture facts as data: weight names and attention features.

Adding a Llama-like architecture means adding a row here, not an ``if`` in the model code.
A config is either a transformers config object (the traced NPU path) or the plain config.json
dict (the CPU/GPU export, which never imports transformers); :func:`config_value` reads both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import DeskfleetError


class UnsupportedArchitectureError(DeskfleetError):
    """The checkpoint's ``model_type`` (or one of its features) is not one the exporter handles."""


@dataclass(frozen=True)
class ArchSpec:
    """Where a decoder-only checkpoint keeps its tensors, and which optional parts it has."""

    model_type: str
    family: str
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
    # None: read ``attention_bias`` from the config; True/False: fixed for the family.
    qkv_bias: bool | None = None
    # False: only the graph builder (export.builder) knows this family; the traced static NPU
    # path (export.modeling) has no q/k norms or fused projections and refuses it.
    traced: bool = True


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(model_type="llama", family="Llama (Llama 2/3/3.x, SmolLM2, TinyLlama)"),
    "mistral": ArchSpec(model_type="mistral", family="Mistral", qkv_bias=False),
    "qwen2": ArchSpec(model_type="qwen2", family="Qwen2 / Qwen2.5", qkv_bias=True),
    "qwen3": ArchSpec(model_type="qwen3", family="Qwen3 (dense)", traced=False),
    "phi3": ArchSpec(model_type="phi3", family="Phi-3 / Phi-3.5 mini", qkv_bias=False, traced=False),
}

# RoPE variants whose frequencies are fixed at export time (a "dynamic" rope changes with length).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "longrope"})


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` of a config.json dict, or the attribute of a transformers config."""
    if isinstance(config, dict):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


def supported_summary() -> str:
    return ", ".join(f"{k} ({v.family})" for k, v in sorted(ARCHITECTURES.items()))


def arch_for(config: Any) -> ArchSpec:
    """Return the spec for a transformers config, or explain what is supported."""
    model_type = config_value(config, "model_type")
    spec = ARCHITECTURES.get(str(model_type))
    if spec is None:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported for export; supported: {supported_summary()}"
        )
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rope.get('rope_type')!r} of this {model_type} checkpoint is not supported; "
            f"supported rope types: {', '.join(sorted(STATIC_ROPE_TYPES))}"
        )
    return spec


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope settings as one dict (transformers 5 keeps them in ``rope_parameters``)."""
    params = config_value(config, "rope_parameters")
    if isinstance(params, dict) and params:
        return dict(params)
    legacy = dict(config_value(config, "rope_scaling") or {})
    legacy.setdefault("rope_type", legacy.pop("type", "default"))
    legacy.setdefault("rope_theta", config_value(config, "rope_theta", 10000.0))
    return legacy


def head_dim(config: Any) -> int:
    explicit = config_value(config, "head_dim")
    return int(explicit or int(config_value(config, "hidden_size")) // int(config_value(config, "num_attention_heads")))


def has_qkv_bias(spec: ArchSpec, config: Any) -> bool:
    if spec.qkv_bias is not None:
        return spec.qkv_bias
    return bool(config_value(config, "attention_bias", False))
