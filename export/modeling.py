"""A traceable torch module for one pipeline stage of a Llama-family decoder.

HF's attention keeps its cache in Python objects and guards rotary with autocast, which
``torch.jit.trace`` cannot follow. This module takes the KV cache as explicit tensors,
computes rotary in fp32 from ``position_ids`` inside the graph, and builds the attention mask
from the coordinator's 2-D ``attention_mask`` (over cache + new positions) so that masked
cache positions (rejected speculative tokens) are invisible. Shapes::

    stage 0 input    input_ids       [B, S]          int64
    later stages     hidden_states   [B, S, H]       float32
    every stage      attention_mask  [B, P + S]      int64   1 = attend, 0 = masked
                     position_ids    [B, S]          int64   logical positions
                     past_key_{i}    [B, KV, P, D]   float32 (becomes device state)
                     past_value_{i}  [B, KV, P, D]
    last stage       logits_last     []              int64   trailing positions to compute logits for
                                                             (0 = all): prefill needs 1, verify K + 1
    outputs          hidden_states_out [B, S, H] or logits [B, n, V], present_key_{i}, ...

With ``stateless=True`` (the static NPU path) there is no ``logits_last`` input (its output
length would be dynamic: the last stage returns logits for all S rows) and the K/V outputs are
only the S new positions, ``new_key_{i}`` [B, KV, S, D]: the host keeps the window in its own
ring and copying the whole window back out every step would be pure waste.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from export.architectures import ArchSpec, has_qkv_bias, head_dim, rope_parameters


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model one stage holds."""

    index: int
    first_layer: int
    last_layer: int  # inclusive
    has_embedding: bool
    has_head: bool

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)


def rotary_inv_freq(config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim / 2] in fp32 and the attention scaling of the config's rope."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(head_dim(config) * float(getattr(config, "partial_rotary_factor", 1.0) or 1.0))
        base = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv, 1.0
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv.to(torch.float32), float(scaling)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, S, D]; cos/sin [B, 1, S, R] with R <= D (partial rotary leaves D - R dims alone)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec, tensors: dict[str, torch.Tensor], layer: int):
        super().__init__()
        p = spec.layer_prefix.format(i=layer)
        bias = has_qkv_bias(spec, config)

        def lin(name: str, with_bias: bool) -> nn.Linear:
            return _linear(tensors[f"{p}{name}.weight"], tensors.get(f"{p}{name}.bias") if with_bias else None)

        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.q_proj, self.k_proj, self.v_proj = lin(spec.q, bias), lin(spec.k, bias), lin(spec.v, bias)
        self.o_proj = lin(spec.o, bool(getattr(config, "attention_bias", False)) and spec.qkv_bias is None)
        self.gate_proj, self.up_proj = lin(spec.gate, mlp_bias), lin(spec.up, mlp_bias)
        self.down_proj = lin(spec.down, mlp_bias)
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(tensors[p + spec.input_norm], eps)
        self.post_attention_layernorm = RMSNorm(tensors[p + spec.post_attn_norm], eps)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = head_dim(config)

    def forward(self, h, mask, cos, sin, past_k, past_v, new_only: bool = False):
        b, s, _ = h.shape
        x = self.input_layernorm(h)
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, N, S, D]
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, S, D]
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # The ReadValue -> Gather(beam_idx) -> Concat -> SDPA chain is what the CPU/GPU plugins
        # fuse into one stateful attention op; keep the concat right next to the state.
        k_new, v_new = k, v  # [B, KV, S, D]
        k = torch.cat((past_k, k), dim=2)  # [B, KV, P + S, D]
        v = torch.cat((past_v, v), dim=2)
        groups = self.num_heads // self.num_kv_heads
        if new_only:
            # Stateless graphs attend over the whole fixed window every step, so K/V are not
            # copied per query head: each KV head's G query heads are folded into the row axis
            # (head h = kv * G + g, row g * S + s) and ``mask`` comes with rows repeated G times.
            # 4-D throughout, like a prefill; measured 4x cheaper attention on the CPU at T=1024.
            qg = q.reshape(b, self.num_kv_heads, groups * s, self.head_dim)  # [B, KV, G*S, D]
            attn = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)  # [B, KV, G*S, D]
            attn = attn.reshape(b, self.num_heads, s, self.head_dim)  # [B, N, S, D]
        else:
            k_all = k[:, :, None].expand(b, self.num_kv_heads, groups, k.shape[2], self.head_dim)
            v_all = v[:, :, None].expand(b, self.num_kv_heads, groups, v.shape[2], self.head_dim)
            k_all = k_all.reshape(b, self.num_heads, k.shape[2], self.head_dim)
            v_all = v_all.reshape(b, self.num_heads, v.shape[2], self.head_dim)
            attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)  # [B, N, S, D]
        attn = attn.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        h = h + self.o_proj(attn)
        x = self.post_attention_layernorm(h)
        h = h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return (h, k_new, v_new) if new_only else (h, k, v)


def attention_bias(attention_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Additive mask [B, 1, S, P + S]: causal over physical positions, minus masked cache slots."""
    total = attention_mask.shape[-1]
    k_idx = torch.arange(total)
    q_idx = torch.arange(seq_len) + (total - seq_len)
    causal = k_idx[None, :] <= q_idx[:, None]  # [S, T]
    allowed = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)
    return (~allowed).to(torch.float32) * torch.finfo(torch.float32).min


class StageModel(nn.Module):
    """Embedding (stage 0) + decoder layers + final norm and head (last stage)."""

    def __init__(self, config: Any, spec: ArchSpec, stage: StageSpec, tensors: dict[str, torch.Tensor],
                 stateless: bool = False):
        super().__init__()
        self.stage = stage
        self.stateless = stateless
        self.embed = nn.Parameter(tensors[spec.embed], requires_grad=False) if stage.has_embedding else None
        self.layers = nn.ModuleList(DecoderLayer(config, spec, tensors, i) for i in stage.layers)
        if stage.has_head:
            self.norm = RMSNorm(tensors[spec.final_norm], float(config.rms_norm_eps))
            head = tensors.get(spec.head)
            if head is None:  # tied embeddings
                head = tensors[spec.embed]
            # A separate copy keeps the head's weight compression independent of the embedding's,
            # so a 1-stage and an N-stage export compress every weight the same way.
            self.lm_head = _linear(head.clone(), None)
        inv_freq, scaling = rotary_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scaling = scaling

    def forward(self, x, attention_mask, position_ids, *rest):
        if self.stage.has_head and not self.stateless:
            logits_last, past = rest[0], rest[1:]
        else:
            logits_last, past = None, rest
        h = F.embedding(x, self.embed) if self.embed is not None else x
        seq_len = h.shape[1]
        freqs = position_ids[:, :, None].to(torch.float32) * self.inv_freq[None, None, :]  # [B, S, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, R]
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        mask = attention_bias(attention_mask, seq_len)  # [B, 1, S, T], the node packing replaces
        if self.stateless:
            groups = self.layers[0].num_heads // self.layers[0].num_kv_heads if len(self.layers) else 1
            b, _, _, t = mask.shape
            mask = mask[:, :, None].expand(b, 1, groups, seq_len, t).reshape(b, 1, groups * seq_len, t)
        presents = []
        for j, layer in enumerate(self.layers):
            h, k, v = layer(h, mask, cos, sin, past[2 * j], past[2 * j + 1], self.stateless)
            presents += [k, v]
        if self.stage.has_head and self.stateless:
            h = self.lm_head(self.norm(h))  # [B, S, V]: every row may be a slot's next token
        elif self.stage.has_head:
            # Only the positions whose logits are wanted go through the head: a prompt of S tokens
            # would otherwise cost S x vocabulary multiply-adds for one useful row.
            n = torch.where(logits_last > 0, logits_last, seq_len)
            keep = torch.arange(torch.clamp(seq_len - n, min=0), seq_len)
            h = self.lm_head(self.norm(h.index_select(1, keep)))
        return (h, *presents)


def stage_tensor_names(config: Any, spec: ArchSpec, stage: StageSpec, available: set[str]) -> list[str]:
    """Exactly the checkpoint tensors this stage needs (selective loading)."""
    names: list[str] = []
    if stage.has_embedding:
        names.append(spec.embed)
    for i in stage.layers:
        p = spec.layer_prefix.format(i=i)
        names += [n for n in available if n.startswith(p)]
    if stage.has_head:
        names.append(spec.final_norm)
        names.append(spec.head if spec.head in available else spec.embed)
    return sorted(set(names))
