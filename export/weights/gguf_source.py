"""A GGUF file as a :class:`~export.weights.checkpoint.TensorSource`: HF names, HF layout, f32.

What a GGUF stores differently from an HF checkpoint, and what is undone here (the same facts
transformers' GGUF loader applies, so both read the same numbers):

- names: ``blk.N.attn_q.weight`` ↔ ``model.layers.N.self_attn.q_proj.weight`` (table below);
- a Qwen3-MoE GGUF (``qwen3moe``) stacks each layer's experts into one 3-D tensor,
  ``blk.N.ffn_gate_exps.weight`` of HF shape ``[experts, out, in]``: each expert is its own HF
  tensor (``model.layers.N.mlp.experts.E.gate_proj.weight``), a window of ``out`` rows into the
  stacked bytes, so the export reads (and dequantises) one expert at a time, never the stack;
  the router ``blk.N.ffn_gate_inp.weight`` is ``mlp.gate.weight``; a layer without a router is a
  dense one (``mlp_only_layers``), and the top-k weights are renormalised as llama.cpp does;
- Phi-3 (``phi3``) keeps its fused projections: ``attn_qkv`` is ``self_attn.qkv_proj`` and its
  ``ffn_up`` is ``mlp.gate_up_proj`` (gate rows first), read as the phi3 family reads a checkpoint;
  its longrope factor lists are the tensors ``rope_factors_long``/``rope_factors_short``, and a
  rope dimension count below the head size (Phi-4-mini) is partial rotary, which the builder refuses;
- shapes: GGUF lists dimensions innermost first; the data itself is row-major ``[out, in]``;
- llama.cpp's converter permutes the rows of Llama's Q and K projections (to interleave the
  rotary halves); for the ``llama`` architecture they are permuted back, per head (KV heads
  for K): ``w.reshape(heads, d / 2, 2, in).swapaxes(1, 2).reshape(d_all, in)``;
- quantised tensors (Q4_0, Q4_1, Q8_0, K-quants...) are dequantised in numpy by the ``gguf``
  package, one row block at a time (each row is a whole number of blocks); the header is
  parsed by :mod:`export.weights.gguf_file` (``gguf.GGUFReader`` costs ~150 MB for a 50k
  vocabulary) and tensor bytes are read from a memory map whose pages are released as read.

:meth:`GGUFSource.blocks` hands out a tensor's raw blocks for the keep-the-quantisation route
(:mod:`export.weights.gguf_blocks`).

Rope frequency factors: llama.cpp's converter writes a Llama 3.1/3.2/3.3 (``rope_type: llama3``)
rope scaling as a tensor, ``rope_freqs.weight`` ([rotary dims / 2] f32, one factor per frequency),
and no ``rope.scaling.type``; ggml's rope divides each dimension's angle by its factor. The factors
go into the config as ``rope_parameters["freq_factors"]`` (a Deskfleet key, not an HF one), and
:mod:`export.builder.rope` divides the inverse frequencies by them. Every other tensor this module
does not map is refused by name: skipping it would export a model that computes something else.
"""

from __future__ import annotations

import math
import mmap
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from export.weights.errors import CheckpointError
from export.weights.gguf_file import TensorInfo

# GGUF key (after "<arch>.") -> HF config key, as transformers maps them.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "vocab_size": "vocab_size",
}
# rope.dimension_count is the head size only where the whole head rotates.
_HEAD_DIM_FROM_ROPE = frozenset({"llama", "mistral"})
_TOKEN_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# A GGUF's general.architecture -> the builder family (export.builder.families) it exports as; a
# "llama" GGUF whose general.name says Mistral is "mistral". Every other architecture is refused.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3moe": "qwen3_moe", "phi3": "phi3"}
_ARCHITECTURE_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM"}
# MoE keys (after "<arch>."), read for the architectures with MoE tensors only.
_MOE_CONFIG_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",
}

# What transformers' configs of these families say and a GGUF leaves implicit.
_FAMILY_DEFAULTS: dict[str, dict] = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "mistral": {"hidden_act": "silu"},
    "qwen2": {"hidden_act": "silu"},
    "qwen3": {"hidden_act": "silu", "attention_bias": False},
    # llama.cpp's qwen3moe graph always renormalises the top-k weights (as transformers' GGUF loader notes)
    "qwen3_moe": {"hidden_act": "silu", "attention_bias": False, "norm_topk_prob": True, "decoder_sparse_step": 1},
    "phi3": {"hidden_act": "silu"},
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Fused projections kept fused, per GGUF architecture: llama.cpp's converter writes Phi-3's
# qkv_proj as attn_qkv and its gate_up_proj (gate rows first, as ggml's swiglu splits it) as ffn_up,
# which is exactly how the phi3 family (export.builder.families) reads them: no split, same bytes.
_FUSED_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# Mixture-of-experts tensors, mapped for these GGUF architectures only (a llama GGUF holding them
# is a Mixtral, which the builder does not build: refused as unread tensors).
_MOE_ARCHITECTURES = frozenset({"qwen3moe"})
_ROUTER = ("ffn_gate_inp", "mlp.gate")
_STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_PLAIN: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_PERMUTED = {"llama": {"self_attn.q_proj.weight": "num_attention_heads",
                       "self_attn.k_proj.weight": "num_key_value_heads"}}

ROPE_FREQS = "rope_freqs.weight"
# Phi-3's longrope (llama.cpp's converter): the HF config's long/short factor lists as f32 tensors of
# [rotary dims / 2], with rope.scaling.original_context_length and rope.scaling.attn_factor; a GGUF
# without them has the default rope. They become the config's longrope rope_parameters.
LONGROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# Rope scaling types a rope_freqs tensor combines with. llama.cpp passes the factors to every rope
# (llama_model::get_rope_factors returns rope_freqs first) together with the scaling type's own
# frequency scale and YaRN ramp: ggml's rope_yarn takes theta / factor as its extrapolated angle and
# freq_scale * theta / factor as its interpolated one, so linear and YaRN apply on top of the
# factors. A "llama3" type would scale twice (the factors are the llama3 scaling), and longrope
# has factor tables of its own: both are refused with rope_freqs present.
_ROPE_TYPES_WITH_FACTORS = ("default", "linear", "yarn")
# GGUF tensors that may be present and are ignored on purpose, with the reason. None so far:
# llama.cpp's loader itself refuses a file holding a tensor it does not claim ("done_getting_tensors:
# wrong number of tensors"), so a GGUF of these architectures that llama.cpp runs has no spare tensor.
IGNORED_TENSORS: dict[str, str] = {}


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The HF tensor name of a GGUF tensor, or ``None`` for tensors HF checkpoints do not have
    (and for stacked experts, which are many HF tensors: :func:`expert_names`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None:
        return None
    if match.group(2) == _ROUTER[0] and architecture in _MOE_ARCHITECTURES:
        return f"model.layers.{match.group(1)}.{_ROUTER[1]}.{match.group(3)}"
    part = _FUSED_NAMES.get(architecture, {}).get(match.group(2)) or _LAYER_NAMES.get(match.group(2))
    if part is None:
        return None
    return f"model.layers.{match.group(1)}.{part}.{match.group(3)}"


def expert_names(gguf_name: str, architecture: str) -> str | None:
    """For a stacked-experts tensor of a MoE architecture, the HF name of its experts with ``{e}``
    for the expert's index (``model.layers.0.mlp.experts.{e}.gate_proj.weight``); else ``None``."""
    match = _LAYER_RE.match(gguf_name)
    if architecture not in _MOE_ARCHITECTURES or match is None or match.group(2) not in _STACKED_EXPERTS:
        return None
    return f"model.layers.{match.group(1)}.mlp.experts.{{e}}.{_STACKED_EXPERTS[match.group(2)]}.{match.group(3)}"


def split_experts(tensor: TensorInfo) -> list[TensorInfo]:
    """The experts of a stacked [experts, out, in] tensor (GGUF dims ``(in, out, experts)``), each a
    2-D window into the same bytes (rows are whole quantisation blocks, so each expert's bytes are
    ``nbytes / experts``); nothing is read."""
    if len(tensor.dims) != 3 or tensor.dims[2] <= 0 or tensor.nbytes % tensor.dims[2]:
        raise CheckpointError(f"stacked experts {tensor.name!r} have shape {list(reversed(tensor.dims))}; "
                              "expected [experts, out, in] with whole rows per expert")
    count = tensor.dims[2]
    each = tensor.nbytes // count
    return [replace(tensor, name=f"{tensor.name} (expert {e})", dims=tensor.dims[:2], offset=tensor.offset + e * each,
                    nbytes=each) for e in range(count)]


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``heads``: attention heads for Q, KV heads for K)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class RawBlocks:
    """A GGUF tensor's stored bytes: ``data`` is uint8 ``[rows, bytes per row]`` (or the plain
    f32/f16 array), ``type_name`` the GGML type (``Q4_1``...), ``shape`` the HF ``[out, in]``."""

    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFSource:
    """A GGUF model file read lazily in HF terms (see the module docstring)."""

    def __init__(self, path: Path):
        # here: the gguf package (~1 s to import, through gguf_file) loads only when a GGUF is opened
        from export.weights.gguf_file import GGUFFile, GGUFFormatError

        self.path = Path(path)
        try:
            self._file = GGUFFile(self.path)
        except (GGUFFormatError, OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.path} is not a readable GGUF file ({exc}); "
                                  "download or copy it again") from exc
        self.architecture = str(self.field("general.architecture") or "")
        # here: the builder's refusals are plain data (no OpenVINO)
        from export.builder.refused import refusal

        if refusal(self.architecture) is not None:
            raise CheckpointError(f"{self.path.name} is a GGUF of architecture {self.architecture!r}: "
                                  f"{refusal(self.architecture)}; supported GGUF architectures: "
                                  f"{', '.join(sorted(GGUF_ARCHITECTURES))} (docs/MODELS.md)")
        if self.architecture not in GGUF_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path.name} is a GGUF of architecture {self.architecture or 'unnamed'!r}, which the exporter "
                f"does not support; supported GGUF architectures: {', '.join(sorted(GGUF_ARCHITECTURES))} "
                "(docs/MODELS.md)")
        self._tensors: dict[str, TensorInfo] = {}
        self._rope_freqs = None
        self._longrope: dict[str, TensorInfo] = {}
        unknown = []
        for tensor in self._file.tensors:
            name = hf_name(tensor.name, self.architecture)
            experts = expert_names(tensor.name, self.architecture)
            if name is not None:
                self._tensors[name] = tensor
            elif experts is not None:
                self._tensors.update({experts.format(e=e): t for e, t in enumerate(split_experts(tensor))})
            elif tensor.name == ROPE_FREQS:
                self._rope_freqs = tensor
            elif tensor.name in LONGROPE_FACTORS and self.architecture == "phi3":
                self._longrope[LONGROPE_FACTORS[tensor.name]] = tensor
            elif tensor.name not in IGNORED_TENSORS:
                unknown.append(tensor.name)
        if unknown:
            shown = ", ".join(unknown[:6]) + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
            raise CheckpointError(
                f"{self.path.name} ({self.architecture or 'no architecture'}) holds tensors the exporter does not "
                f"read: {shown}. Ignoring them would change the model's math; supported are the decoder tensors "
                f"of llama (Llama, Mistral), qwen2, qwen3, qwen3moe and phi3 GGUFs, {ROPE_FREQS} and phi3's "
                f"{' and '.join(LONGROPE_FACTORS)}")
        self._map: np.memmap | None = None
        self.config = self._config()

    # -- metadata ------------------------------------------------------------------------

    @property
    def metadata(self) -> dict:
        """Every metadata key -> plain value (for the tokenizer files: no second parse)."""
        return self._file.fields

    def field(self, key: str):
        """A metadata value (``str``/number/list), or ``None`` when the GGUF does not have it."""
        return self._file.fields.get(key)

    def _config(self) -> dict:
        arch = self.architecture
        name = str(self.field("general.name") or "").lower()
        model_type = "mistral" if arch == "llama" and "mistral" in name else GGUF_ARCHITECTURES[arch]
        config: dict = {"model_type": model_type}
        if model_type in _ARCHITECTURE_CLASSES:
            config["architectures"] = [_ARCHITECTURE_CLASSES[model_type]]
        for key, hf_key in _CONFIG_KEYS.items():
            value = self.field(f"{arch}.{key}")
            if value is not None:
                config[hf_key] = value
        if arch in _MOE_ARCHITECTURES:
            config.update(self._moe_config(arch))
        rope_dims = self.field(f"{arch}.rope.dimension_count")
        if rope_dims is not None and arch in _HEAD_DIM_FROM_ROPE:
            config["head_dim"] = rope_dims
        for key, hf_key in _TOKEN_KEYS.items():
            value = self.field(key)
            if value is not None:
                config[hf_key] = value
        if "vocab_size" not in config:
            tokens = self.field("tokenizer.ggml.tokens")
            if tokens is not None:
                config["vocab_size"] = len(tokens)
            elif "model.embed_tokens.weight" in self._tensors:
                config["vocab_size"] = self.shape("model.embed_tokens.weight")[0]
        config["tie_word_embeddings"] = "lm_head.weight" not in self._tensors
        config.update({k: v for k, v in _FAMILY_DEFAULTS.get(model_type, {}).items() if k not in config})
        if config.get("head_dim") is None and "hidden_size" in config and "num_attention_heads" in config:
            config["head_dim"] = int(config["hidden_size"]) // int(config["num_attention_heads"])
        rope: dict = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0))}
        scaling = self.field(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            rope["rope_type"] = str(scaling)
            factor = self.field(f"{arch}.rope.scaling.factor")
            original = self.field(f"{arch}.rope.scaling.original_context_length")
            if factor is not None:
                rope["factor"] = float(factor)
            if original is not None:
                rope["original_max_position_embeddings"] = int(original)
        if self._rope_freqs is not None:
            if rope["rope_type"] not in _ROPE_TYPES_WITH_FACTORS:
                raise CheckpointError(
                    f"{self.path.name} has both {ROPE_FREQS} and rope scaling type {rope['rope_type']!r}; the "
                    f"factors combine with {', '.join(_ROPE_TYPES_WITH_FACTORS)} scaling only (see llama.cpp)")
            rope["freq_factors"] = [float(f) for f in self._read_rope_freqs(config.get("head_dim"))]
        elif self._longrope:
            rope.update(self._longrope_parameters(config))
        elif rope["rope_type"] == "llama3":
            # llama.cpp's converter writes llama3 scaling as rope_freqs, never as a scaling type: a
            # bare type carries none of the low/high frequency factors it needs.
            raise CheckpointError(
                f"{self.path.name} names rope scaling type {rope['rope_type']!r} but carries no {ROPE_FREQS} "
                "frequency factors; convert the checkpoint again with a current llama.cpp convert_hf_to_gguf.py")
        config["rope_parameters"] = rope
        if arch == "phi3" and rope_dims is not None and rope_dims != config.get("head_dim"):
            # Phi-4-mini is a phi3 GGUF rotating part of each head: the builder refuses it by this key
            config["partial_rotary_factor"] = int(rope_dims) / int(config["head_dim"])
        if arch in ("qwen2",):
            config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self._tensors
        return config

    def _moe_config(self, arch: str) -> dict:
        """The MoE keys of the config; the dense layers are those without a router tensor."""
        config = {hf_key: self.field(f"{arch}.{key}") for key, hf_key in _MOE_CONFIG_KEYS.items()
                  if self.field(f"{arch}.{key}") is not None}
        layers = self.field(f"{arch}.block_count")
        if isinstance(layers, int):
            config["mlp_only_layers"] = [i for i in range(layers) if f"model.layers.{i}.mlp.gate.weight" not in
                                         self._tensors]
        return config

    def _longrope_parameters(self, config: dict) -> dict:
        """Phi-3's longrope as HF's rope_parameters, from its two factor tensors and scaling keys."""
        arch = self.architecture
        original = self.field(f"{arch}.rope.scaling.original_context_length")
        lacking = sorted(set(LONGROPE_FACTORS) - {t.name for t in self._longrope.values()})
        lacking += [] if original is not None else [f"{arch}.rope.scaling.original_context_length"]
        if lacking:
            raise CheckpointError(f"{self.path.name} has longrope factors but lacks {', '.join(lacking)}; convert the "
                                  "checkpoint again with a current llama.cpp convert_hf_to_gguf.py")
        rope_dims = int(self.field(f"{arch}.rope.dimension_count") or config.get("head_dim") or 0)
        out: dict = {"rope_type": "longrope", "original_max_position_embeddings": int(original)}
        for key, tensor in self._longrope.items():
            out[key] = [float(f) for f in self._read_factors(tensor, rope_dims)]
        # HF derives the attention factor from max / original positions when the config names none;
        # the GGUF stores that same number in f32, so it is passed on only when it says otherwise.
        given = self.field(f"{arch}.rope.scaling.attn_factor")
        scale = float(config.get("max_position_embeddings", original)) / float(original)
        derived = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(float(original)))
        if given is not None and abs(float(given) - derived) > 1e-6 * derived:
            out["attention_factor"] = float(given)
        return out

    def _read_rope_freqs(self, head_dim: object) -> np.ndarray:
        """The rope frequency factors, f32 [head_dim / 2], checked (read here: no HF name)."""
        tensor = self._rope_freqs
        assert tensor is not None
        return self._read_factors(tensor, head_dim)

    def _read_factors(self, tensor: TensorInfo, head_dim: object) -> np.ndarray:
        """A rope factor tensor (one factor per rotary frequency), f32 [head_dim / 2], checked."""
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise CheckpointError(f"{self.path.name} has {tensor.name} but no head size to check it against")
        # here: the gguf package (~1 s to import) loads only with a GGUF open
        from gguf import GGMLQuantizationType

        kind = GGMLQuantizationType(tensor.type_id).name
        if kind not in ("F32", "F16") or tensor.dims != (head_dim // 2,):
            raise CheckpointError(
                f"{tensor.name} of {self.path.name} is {kind} of shape {list(tensor.dims)}; expected F32 (or F16) of "
                f"shape [{head_dim // 2}] (one factor per rotary frequency of the {head_dim}-wide heads)")
        with self.path.open("rb") as f:
            f.seek(tensor.offset)
            raw = f.read(tensor.nbytes)
        factors = np.frombuffer(raw, dtype=_PLAIN[kind]).astype(np.float32)
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise CheckpointError(f"{tensor.name} of {self.path.name} holds zero, negative or non-finite factors; "
                                  "the file is damaged")
        return factors

    # -- tensors -------------------------------------------------------------------------

    def names(self) -> frozenset[str]:
        return frozenset(self._tensors)

    def stored_name(self, name: str) -> str:
        """The GGUF's own name of HF tensor ``name`` (``blk.0.attn_output.bias``), for messages."""
        return self._tensor(name).name

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in {self.path.name}; the GGUF is incomplete "
                                  "or of another architecture") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self._tensor(name).dims))

    def _qtype(self, name: str):
        # as above: gguf loads with a GGUF open
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self._tensor(name).type_id)

    def type_name(self, name: str) -> str:
        """The GGML storage type of ``name`` (``F32``, ``F16``, ``Q4_1``, ``Q8_0``...)."""
        return self._qtype(name).name

    def _permuted_heads(self, name: str) -> int | None:
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
        key = _PERMUTED.get(self.architecture, {}).get(suffix)
        return int(self.config[key]) if key else None

    def blocks(self, name: str) -> RawBlocks:
        """The stored bytes of ``name`` (rows in GGUF order; see :meth:`row_order`)."""
        tensor = self._tensor(name)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        data = self._map[tensor.offset:tensor.offset + tensor.nbytes]
        shape = self.shape(name)
        plain = _PLAIN.get(self.type_name(name))
        if plain is not None:
            data = data.view(plain).reshape(shape)
        else:
            rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            data = data.reshape(rows, -1)
        return RawBlocks(self.type_name(name), shape, data)

    def row_order(self, name: str) -> np.ndarray | None:
        """For a permuted Q/K tensor: the stored row holding each HF row; else ``None``."""
        heads = self._permuted_heads(name)
        if heads is None:
            return None
        rows = self.shape(name)[0]
        return unpermute_rows(np.arange(rows)[:, None], heads)[:, 0]

    def read(self, name: str) -> np.ndarray:
        rows = self.shape(name)[0] if self.shape(name) else 1
        return self.read_rows(name, 0, rows) if len(self.shape(name)) > 1 else self._dequantize(name, 0, rows)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        shape = self.shape(name)
        if not 0 <= start <= stop <= shape[0]:
            raise CheckpointError(f"rows [{start}, {stop}) are outside tensor {name!r} of shape {list(shape)}")
        order = self.row_order(name)
        if order is None:
            return self._dequantize(name, start, stop)
        return self._dequantize(name, start, stop, rows=order[start:stop])  # the stored rows of these HF rows

    def _dequantize(self, name: str, start: int, stop: int, rows: np.ndarray | None = None) -> np.ndarray:
        # as above: gguf loads with a GGUF open
        from gguf import GGMLQuantizationType, dequantize

        raw = self.blocks(name)
        values = raw.data[start:stop] if rows is None else raw.data[rows]
        qtype = self._qtype(name)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            out = np.array(values, dtype=np.float32, copy=True)
        elif qtype == GGMLQuantizationType.BF16:
            out = (np.asarray(values).astype(np.uint32) << 16).view(np.float32)
        else:
            out = dequantize(np.asarray(values), qtype).astype(np.float32, copy=False)
        out = np.ascontiguousarray(out, dtype=np.float32)
        self.release(values if rows is None else raw.data)
        return out.reshape((stop - start, *raw.shape[1:]))

    def release(self, view: np.ndarray) -> None:
        """Drop the file pages of ``view`` (a slice of :meth:`blocks` data) from this process's
        RSS once read; they stay in the page cache, so reading them again costs no disk I/O."""
        mapped = getattr(self._map, "_mmap", None)
        if self._map is None or mapped is None or view.size == 0:
            return
        base = self._map.ctypes.data
        begin = view.ctypes.data - base
        end = begin + view.nbytes
        page = mmap.PAGESIZE
        first, last = (begin + page - 1) // page * page, end // page * page  # whole pages only
        if last > first:
            try:
                mapped.madvise(mmap.MADV_DONTNEED, first, last - first)
            except (OSError, ValueError, AttributeError):
                pass

    def close(self) -> None:
        self._map = None

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
