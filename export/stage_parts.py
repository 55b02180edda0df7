"""The traced NPU path's torch helpers: checkpoint tensors as torch tensors, example inputs, ports.

:func:`export.static_export.export_static_stage` traces a stage module from these. Only that
path imports this module (torch at the top): the options and errors every path shares are in
the torch-free :mod:`export.options` (re-exported here for the NPU modules).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openvino as ov
import torch
from safetensors import safe_open

from engine.shards.manifest import TensorSpec
from export.architectures import head_dim
from export.modeling import StageSpec
from export.options import XML_NAME, ExportError, ExportOptions, Progress

__all__ = ["XML_NAME", "CheckpointReader", "ExportError", "ExportOptions", "Progress", "estimate_memory",
           "example_inputs", "io_names", "spec_of"]


class CheckpointReader:
    """Lazy access to the tensors of an HF safetensors checkpoint, one tensor at a time."""

    def __init__(self, checkpoint_dir: Path):
        files = sorted(checkpoint_dir.glob("*.safetensors"))
        if not files:
            raise ExportError(f"{checkpoint_dir} has no *.safetensors files; is it an HF checkpoint directory?")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    self._where[key] = f

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def load(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self._where:
                raise ExportError(f"checkpoint tensor {n!r} is missing; the checkpoint is incomplete")
            by_file.setdefault(self._where[n], []).append(n)
        for f, keys in by_file.items():
            with safe_open(str(f), framework="pt") as st:
                for k in keys:
                    out[k] = st.get_tensor(k).to(torch.float32)
        return out


def io_names(stage: StageSpec, stateless: bool = False) -> tuple[list[str], list[str]]:
    first = "input_ids" if stage.has_embedding else "hidden_states"
    inputs = [first, "attention_mask", "position_ids"]
    if stage.has_head and not stateless:
        inputs.append("logits_last")
    outputs = ["logits" if stage.has_head else "hidden_states_out"]
    present = "new" if stateless else "present"  # stateless graphs return only the S new positions
    for i in stage.layers:
        inputs += [f"past_key_{i}", f"past_value_{i}"]
        outputs += [f"{present}_key_{i}", f"{present}_value_{i}"]
    return inputs, outputs


def example_inputs(config: Any, stage: StageSpec, stateless: bool = False) -> tuple[torch.Tensor, ...]:
    """Real tensors for tracing: S=3 new tokens over P=2 cached ones (every dimension converts dynamic)."""
    s, p = 3, 2
    kv, d = int(config.num_key_value_heads), head_dim(config)
    if stage.has_embedding:
        x = torch.randint(0, int(config.vocab_size), (1, s), dtype=torch.int64)
    else:
        x = torch.randn(1, s, int(config.hidden_size))
    tensors = [x, torch.ones(1, p + s, dtype=torch.int64), torch.arange(p, p + s, dtype=torch.int64)[None]]
    if stage.has_head and not stateless:
        tensors.append(torch.tensor(2, dtype=torch.int64))  # logits for the last 2 of the 3 positions
    for _ in stage.layers:
        tensors += [torch.randn(1, kv, p, d), torch.randn(1, kv, p, d)]
    return tuple(tensors)


def spec_of(port: ov.Output) -> TensorSpec:
    shape = tuple(-1 if dim.is_dynamic else dim.get_length() for dim in port.get_partial_shape())
    return TensorSpec(name=port.get_any_name(), dtype=port.get_element_type().get_type_name(), shape=shape)


def estimate_memory(config: Any, stage: StageSpec, file_bytes: int, kv_precision: str, context: int) -> int:
    """Shard files + KV at ``context`` positions + scratch. For an NPU stage ``context`` is the
    fixed window and the KV is the host ring (f32): it is allocated in full from the start."""
    kv_bytes = {"f32": 4, "f16": 2, "u8": 1}[kv_precision]
    per_token = 2 * stage.last_layer - 2 * stage.first_layer + 2
    kv = per_token * int(config.num_key_value_heads) * head_dim(config) * kv_bytes * context
    activations = 64 * 1024 * 1024  # compiled-graph scratch, measured order of magnitude on CPU
    return file_bytes + kv + activations
