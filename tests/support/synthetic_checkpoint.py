"""Random-weight HF checkpoints of a given shape, written as a stream (never whole in memory).

For the memory tests and the export-memory benchmark (tests/benchmarks/export_memory.py): a
Llama-shaped safetensors checkpoint (bf16, f16 or f32) whose header is written first and whose
tensors follow in row blocks of seeded random values, so an 8B-shaped checkpoint (~16 GB) is
produced with a few MB of RSS.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
_BLOCK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA31_8B = LlamaShape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)


def llama_config(shape: LlamaShape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": shape.tie_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def llama_tensors(shape: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of a Llama checkpoint, in file order."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (shape.heads * shape.head_dim, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, shape.heads * shape.head_dim)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (shape.intermediate, h)),
            (p + "mlp.up_proj.weight", (shape.intermediate, h)),
            (p + "mlp.down_proj.weight", (h, shape.intermediate)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not shape.tie_embeddings:
        out.append(("lm_head.weight", (shape.vocab, h)))
    return out


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return values.astype("<f4")
    if dtype == "F16":
        return values.astype("<f2")
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: str,
                      blocks: Callable[[str, tuple[int, ...]], Iterator[np.ndarray]]) -> int:
    """Write ``tensors`` (name, shape) to ``path``, each from ``blocks(name, shape)`` (f32 row
    blocks in order). Returns the file size."""
    item = _ITEMSIZE[dtype]
    header: dict = {}
    offset = 0
    for name, shape in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * item
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in tensors:
            written = 0
            for block in blocks(name, shape):
                written += f.write(memoryview(_encode(block, dtype)).cast("B"))
            if written != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                raise ValueError(f"{name}: the blocks gave {written} bytes for shape {list(shape)}")
    return path.stat().st_size


def random_blocks(seed: int, scale: float = 0.05) -> Callable[[str, tuple[int, ...]], Iterator[np.ndarray]]:
    """Seeded normal row blocks (norm gammas around 1), a few MB at a time."""

    def blocks(name: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        rng = np.random.default_rng([seed, *name.encode()])
        if len(shape) == 1:
            yield 1.0 + np.float32(0.1) * rng.standard_normal(shape, dtype=np.float32)
            return
        rows, cols = shape
        step = max(1, _BLOCK_BYTES // (4 * cols))
        for start in range(0, rows, step):
            block = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
            block *= np.float32(scale)
            yield block

    return blocks


def write_synthetic_llama(directory: Path, shape: LlamaShape, dtype: str = "BF16", seed: int = 0) -> Path:
    """A random-weight Llama checkpoint directory (config.json + model.safetensors)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = llama_config(shape)
    config["torch_dtype"] = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[dtype]
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_safetensors(directory / "model.safetensors", llama_tensors(shape), dtype, random_blocks(seed))
    return directory


@dataclass(frozen=True)
class Qwen3MoeShape:
    """A Qwen3-MoE checkpoint's shape (every layer sparse, no shared expert)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    per_token: int
    expert_intermediate: int
    vocab: int


# Qwen3-30B-A3B's config.json: 48 layers, 128 experts of width 768, 8 per token.
QWEN3_30B_A3B = Qwen3MoeShape(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, per_token=8,
                              expert_intermediate=768, vocab=151936)


def qwen3_moe_config(shape: Qwen3MoeShape) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": shape.hidden,
        "intermediate_size": 6144,  # the dense MLP width, unused: every layer is sparse
        "moe_intermediate_size": shape.expert_intermediate,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.per_token,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }


def qwen3_moe_tensors(shape: Qwen3MoeShape) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of a Qwen3-MoE checkpoint, in file order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "self_attn.q_norm.weight", (shape.head_dim,)),
                (p + "self_attn.k_norm.weight", (shape.head_dim,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate.weight", (shape.experts, h))]
        for e in range(shape.experts):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (shape.expert_intermediate, h)),
                    (p + f"mlp.experts.{e}.up_proj.weight", (shape.expert_intermediate, h)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (h, shape.expert_intermediate))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (shape.vocab, h))]
    return out
