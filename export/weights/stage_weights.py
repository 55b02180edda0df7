"""One stage's weights as OpenVINO subgraphs: read → quantise → constant → release.

Every weight is lowered by a rule that depends only on what the weight is, never on the stage it
sits in (the rule the torch exporter's two NNCF passes followed): in an INT4 export the decoder layers'
matrices are INT4 and everything outside them (embedding, LM head) INT8 asymmetric per channel,
so an N-stage INT4 export holds exactly the values of the 1-stage one.

The subgraphs are the ones NNCF / ``ov.save_model(compress_to_fp16=True)`` emit, which the
CPU/GPU plugins keep compressed at run time::

    fp16:      f16 Constant ─ Convert f32 (marked "decompression")
    int8_asym: u8 [out, in] ─ Convert f16 ─ Subtract(u8 zp [out, 1] ─ Convert f16)
               ─ Multiply(f16 scale [out, 1]) ─ Convert f32
    int4_asym: u4 [out, in/g, g] ─ Convert f16 ─ Subtract(u4 zp [out, in/g, 1] ─ Convert f16)
               ─ Multiply(f16 scale [out, in/g, 1]) ─ Reshape [out, in] ─ Convert f32
    int4_sym:  i4 [out, in/g, g] ─ Convert f16 ─ Multiply(f16 scale [out, in/g, 1])
               ─ Reshape [out, in] ─ Convert f32

The integer codes, scales and zero points are those of :mod:`export.weights.rtn`, equal to
``nncf.compress_weights``'s; NNCF itself leaves these Converts unmarked (the plugins recognise
the pattern), so only the fp16 Convert carries the ``decompression`` mark.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import DeskfleetError
from export.weights.checkpoint import TensorSource
from export.weights.gguf_blocks import KEPT_TYPES, decode
from export.weights.gguf_source import RawBlocks
from export.weights.rtn import Scheme, grouped_shape, quantize, row_block, scheme_for
from export.weights.weight_file import ConstantSpec, MemoryConstants, WeightFile, pack_nibbles

KINDS = ("int4_sym", "int4_asym", "int8_asym", "fp16", "fp32", "gguf_keep")
_DECODER = re.compile(r"(^|\.)layers\.\d+\.")


class WeightModeError(DeskfleetError):
    """A weight mode is unknown, or its group size does not divide a weight's input dimension."""


@runtime_checkable
class KeptSource(Protocol):
    """What ``gguf_keep`` needs beyond a :class:`TensorSource`: the stored blocks (a GGUF's)."""

    def type_name(self, name: str) -> str: ...

    def blocks(self, name: str) -> RawBlocks: ...

    def row_order(self, name: str) -> np.ndarray | None: ...


@dataclass(frozen=True)
class WeightMode:
    kind: str  # one of KINDS
    group_size: int = 64  # INT4 only: values per scale along the input dimension

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WeightModeError(f"unknown weight mode {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind.startswith("int4") and self.group_size <= 0:
            raise WeightModeError(f"INT4 group size must be positive, got {self.group_size}")


# What the non-decoder weights (embedding, LM head) become under each stage mode.
_OUTSIDE_DECODER: dict[str, str] = {
    "int4_sym": "int8_asym",
    "int4_asym": "int8_asym",
    "int8_asym": "int8_asym",
    "fp16": "fp16",
    "fp32": "fp32",
    "gguf_keep": "gguf_keep",
}
# gguf_keep: a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks become constants as they are
# (export.weights.gguf_blocks), a MoE layer's experts too (one stacked constant, each expert its own
# blocks); F16 and F32 matrices stay fp16/fp32; any other GGML type (Q5_*, Q2_K, Q3_K, Q5_K, IQ*) is
# dequantised to fp16.
_KEEP_FALLBACK = {"F16": "fp16", "F32": "fp32"}


def kind_for(name: str, mode: WeightMode) -> str:
    """The lowering of matrix ``name`` under ``mode`` (decoder matrices take the mode itself)."""
    return mode.kind if _DECODER.search(name) else _OUTSIDE_DECODER[mode.kind]


@functools.lru_cache(maxsize=1)
def _decompression_attribute() -> tuple[str, object] | None:
    """The typed ``decompression`` rt_info value that keeps a f16→f32 Convert from being folded.

    Python cannot construct it, so it is taken from a one-element model that OpenVINO's own fp16
    compression (what ``save_model(compress_to_fp16=True)`` runs) has marked.
    """
    try:
        # here: a private OpenVINO module, absent from some builds (optional)
        from openvino._offline_transformations import compress_model_transformation
    except ImportError:  # pragma: no cover - an OpenVINO without it: the Convert just folds
        return None
    probe = ov.Model([ops.convert(ops.constant(np.ones(1, np.float32)), "f32")], [])
    compress_model_transformation(probe)
    for node in probe.get_ordered_ops():
        info = node.get_rt_info()
        for key in ("decompression_0", "decompression"):
            if key in info:
                return key, info[key]
    return None  # pragma: no cover


def mark_decompression(node: ov.Node) -> None:
    found = _decompression_attribute()
    if found is not None:
        key, attribute = found
        node.set_rt_info(attribute, key)


class StageWeights:
    """Builds one stage's weight subgraphs from a :class:`TensorSource`; a context manager.

    With ``bin_path`` every constant is written to that scratch file as it is produced and
    memory-mapped back (:class:`~export.weights.weight_file.WeightFile`); closing deletes the
    file, and the constants stay valid until the graph is gone. Without it constants are
    ordinary memory. ``linear`` / ``embedding`` return the same node when asked twice for one
    tensor (a tied head and its embedding share one compressed constant), and the graphs of an
    NPU stage (built one after the other over one StageWeights) share every matrix constant.
    """

    def __init__(self, source: TensorSource, mode: WeightMode, bin_path: Path | None = None):
        self.source = source
        self.mode = mode
        self._store: WeightFile | MemoryConstants = WeightFile(bin_path) if bin_path else MemoryConstants()
        self._built: dict[tuple[str, str], ov.Output] = {}

    def __enter__(self) -> StageWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._built.clear()
        self._store.close()

    # -- public --------------------------------------------------------------------------

    def linear(self, name: str) -> ov.Output:
        """f32 ``[out, in]`` weight for ``MatMul(x, w, transpose_b=True)``."""
        return self._matrix(name, kind_for(name, self.mode))

    def embedding(self, name: str) -> ov.Output:
        """f32 ``[vocab, hidden]`` table for ``Gather(table, ids, axis=0)``."""
        return self._matrix(name, kind_for(name, self.mode))

    def stacked(self, names: list[str]) -> ov.Output:
        """f32 ``[len(names), out, in]``: equal-shaped matrices (one per expert) as one constant for a
        batched ``MatMul(x [E, T, in], w, transpose_b=True)``. Each matrix is lowered on its own (its
        own scales and zero points: quantised per expert) and streamed into the store one after another."""
        key = ("|".join(names), "stacked")
        if key not in self._built:
            shapes = {tuple(int(d) for d in self.source.shape(n)) for n in names}
            if len(shapes) != 1 or len(next(iter(shapes))) != 2:
                raise WeightModeError(f"{names[0]} and the matrices stacked with it must be 2-D of one shape, "
                                      f"got {sorted(shapes)}")
            rows, cols = next(iter(shapes))
            self._built[key] = self._lower(tuple(names), (rows, cols), kind_for(names[0], self.mode))
        return self._built[key]

    def vector(self, name: str) -> ov.Output:
        """f32 1-D constant (norm gammas, biases), stored as read."""
        shape = self.source.shape(name)
        if len(shape) != 1:
            raise WeightModeError(f"{name} has shape {list(shape)}; vector() expects a 1-D tensor")
        return self._one(self.source.read(name), "f32", name)

    # -- lowering ------------------------------------------------------------------------

    def _matrix(self, name: str, kind: str) -> ov.Output:
        key = (name, kind)
        if key not in self._built:
            shape = self.source.shape(name)
            if len(shape) != 2:
                raise WeightModeError(f"{name} has shape {list(shape)}; a matrix weight must be 2-D")
            self._built[key] = self._lower(name, (int(shape[0]), int(shape[1])), kind)
        return self._built[key]

    def _blocks(self, name: str | tuple[str, ...], rows: int, cols: int):
        """Row blocks of one matrix, or of each of a stack of matrices in turn."""
        step = row_block(rows, cols)
        if cols % 2:
            step += step % 2  # keep 4-bit packing on byte boundaries
        for member in (name,) if isinstance(name, str) else name:
            for start in range(0, rows, step):
                yield self.source.read_rows(member, start, min(rows, start + step))

    def _lower(self, names: str | tuple[str, ...], shape: tuple[int, int], kind: str) -> ov.Output:
        """One matrix ``names`` [rows, cols], or a stack of them [len(names), rows, cols]."""
        rows, cols = shape
        lead = () if isinstance(names, str) else (len(names),)
        name = names if isinstance(names, str) else names[0]
        if kind in ("fp32", "fp16"):
            dtype, type_name = (np.float32, "f32") if kind == "fp32" else (np.float16, "f16")
            region = self._store.write(b.astype(dtype, copy=False) for b in self._blocks(names, rows, cols))
            (const,) = self._store.constants([ConstantSpec(region, type_name, lead + shape, name)])
            if kind == "fp32":
                return const.output(0)
            convert = ops.convert(const, "f32", name=f"{name}/decompress")
            mark_decompression(convert)
            return convert.output(0)
        if kind == "gguf_keep":
            return self._lower_kept(names, shape)
        return self._lower_integer(names, shape, scheme_for(kind, self.mode.group_size))

    def _lower_kept(self, names: str | tuple[str, ...], shape: tuple[int, int]) -> ov.Output:
        """One GGUF matrix ``names`` [rows, cols], or a stack of them (a layer's experts, each its own
        window of a stacked GGUF tensor) [len(names), rows, cols], from their stored blocks."""
        source = self.source
        if not isinstance(source, KeptSource):
            raise WeightModeError("gguf_keep keeps a GGUF's own quantisation, but this checkpoint is not a GGUF; "
                                  "choose int4_sym, int4_asym, int8_asym, fp16 or fp32")
        members = (names,) if isinstance(names, str) else names
        lead = () if isinstance(names, str) else (len(names),)
        name = members[0]
        types = {source.type_name(member) for member in members}
        if len(types) != 1:
            raise WeightModeError(f"{name} and the matrices stacked with it are stored as {', '.join(sorted(types))}; "
                                  "gguf_keep keeps one stack in one type: export with int4_sym or int8_asym instead")
        type_name = types.pop()
        if type_name not in KEPT_TYPES:
            return self._lower(names, shape, _KEEP_FALLBACK.get(type_name, "fp16"))
        rows, cols = shape
        step = row_block(rows, cols)
        scales: list[np.ndarray] = []
        zeros: list[np.ndarray] = []
        probe = decode(type_name, source.blocks(name).data[:1])
        code_type, group = probe.code_type, probe.codes.shape[-1]
        float_type = "f16" if probe.scale.dtype == np.float16 else "f32"  # K-quants: f32 scales

        release = getattr(self.source, "release", lambda view: None)

        def codes():
            for member in members:
                raw = source.blocks(member).data  # uint8 [rows, bytes per row], GGUF row order
                order = source.row_order(member)
                for start in range(0, rows, step):
                    picked = raw[start:start + step] if order is None else raw[order[start:start + step]]
                    block = decode(type_name, picked)
                    if order is None:
                        release(picked)  # mapped GGUF pages leave this process's RSS once decoded
                    scales.append(block.scale)
                    if block.zero_point is not None:
                        zeros.append(block.zero_point)
                    yield pack_nibbles(block.codes) if code_type in ("u4", "i4") else block.codes
                release(raw)

        grouped = (rows, cols // group, group)
        region = self._store.write(codes())
        scale = np.concatenate(scales)
        scale = scale.reshape(lead + (rows,) + scale.shape[1:])
        specs = [ConstantSpec(region, code_type, lead + grouped, name),
                 ConstantSpec(self._store.write([scale]), float_type, scale.shape, f"{name}/scale")]
        if zeros:
            zero = np.concatenate(zeros)
            zero = zero.reshape(lead + (rows,) + zero.shape[1:])
            specs.append(ConstantSpec(self._store.write([zero]), float_type, zero.shape, f"{name}/zero_point"))
        nodes = self._store.constants(specs)
        weight = ops.convert(nodes[0], float_type)
        if zeros:
            weight = ops.subtract(weight, nodes[2], name=f"{name}/zero_point/subtract")
        weight = ops.multiply(weight, nodes[1], name=f"{name}/fq_weights")
        weight = ops.reshape(weight, ops.constant(np.array(lead + shape, np.int64)), special_zero=False)
        return ops.convert(weight, "f32", name=f"{name}/fq_weights/convert").output(0)

    def _lower_integer(self, names: str | tuple[str, ...], shape: tuple[int, int], scheme: Scheme) -> ov.Output:
        """Quantise row block by row block straight into the store; scales follow in one piece.
        A stack's matrices are quantised one by one (their rows never share a scale)."""
        rows, cols = shape
        lead = () if isinstance(names, str) else (len(names),)
        name = names if isinstance(names, str) else names[0]
        grouped = grouped_shape(shape, scheme)
        scales: list[np.ndarray] = []
        zeros: list[np.ndarray] = []
        four_bit = scheme.bits == 4

        def codes():
            for block in self._blocks(names, rows, cols):
                q = quantize(block, scheme)
                scales.append(q.scale)
                if q.zero_point is not None:
                    zeros.append(q.zero_point)
                yield pack_nibbles(q.values) if four_bit else q.values

        code_type = ("i4" if four_bit else "i8") if scheme.symmetric else ("u4" if four_bit else "u8")
        region = self._store.write(codes())
        scale = np.concatenate(scales)
        scale = scale.reshape(lead + (rows,) + scale.shape[1:])
        specs = [ConstantSpec(region, code_type, lead + grouped, name),
                 ConstantSpec(self._store.write([scale]), "f16", scale.shape, f"{name}/scale")]
        if zeros:
            zero = np.concatenate(zeros)
            zero = zero.reshape(lead + (rows,) + zero.shape[1:])
            zero_bytes = pack_nibbles(zero) if four_bit else zero
            specs.append(ConstantSpec(self._store.write([zero_bytes]), code_type, zero.shape, f"{name}/zero_point"))
        nodes = self._store.constants(specs)
        # NNCF's decompression subgraph, node for node (see the module docstring).
        weight = ops.convert(nodes[0], "f16")
        if zeros:
            weight = ops.subtract(weight, ops.convert(nodes[2], "f16"), name=f"{name}/zero_point/subtract")
        weight = ops.multiply(weight, nodes[1], name=f"{name}/fq_weights")
        if scheme.group_size is not None:
            weight = ops.reshape(weight, ops.constant(np.array(lead + shape, np.int64)), special_zero=False)
        return ops.convert(weight, "f32", name=f"{name}/fq_weights/convert").output(0)

    def _one(self, values: np.ndarray, type_name: str, name: str) -> ov.Output:
        region = self._store.write([values])
        (const,) = self._store.constants([ConstantSpec(region, type_name, tuple(values.shape), name)])
        return const.output(0)
