"""Where a stage's constants live while its graph is built: a memory-mapped scratch file.

Each lowered tensor is appended to the stage's scratch weight file the moment it is produced,
then handed back as OpenVINO ``Constant`` nodes that *OpenVINO itself* memory-maps: a tiny IR
(``Const`` layers pointing at offsets in the file) is read with ``Core.read_model``, whose IR
reader maps the .bin read-only and ties the mapping's lifetime to the nodes. So no stage is
ever whole in anonymous memory: its weights are file-backed pages the kernel can drop, and
``ov.save_model`` streams them into the final IR.

(A numpy ``memmap`` handed to ``ov.Tensor(array, shape, type)`` would also share memory, but
OpenVINO does not keep the array alive; the constant would dangle as soon as Python let go.)

:class:`MemoryConstants` is the same interface without a file, for small graphs and tests.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

_ALIGN = 64  # bytes; every tensor starts on a cache-line boundary, as OpenVINO's own .bin does
_PRECISION = {"f32": "FP32", "f16": "FP16", "u8": "U8", "i8": "I8", "u4": "U4", "i4": "I4", "i64": "I64"}
_OV_TYPES = {"f32": ov.Type.f32, "f16": ov.Type.f16, "u8": ov.Type.u8, "i8": ov.Type.i8, "u4": ov.Type.u4,
             "i4": ov.Type.i4, "i64": ov.Type.i64}
_BITS = {"f32": 32, "f16": 16, "u8": 8, "i8": 8, "u4": 4, "i4": 4, "i64": 64}


def packed_size(element_type: str, shape: tuple[int, ...]) -> int:
    """Bytes OpenVINO stores for ``shape`` of ``element_type`` (4-bit types: two values a byte)."""
    count = int(np.prod(shape, dtype=np.int64))
    return (count * _BITS[element_type] + 7) // 8


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """u4/i4 codes (one per uint8/int8) into OpenVINO's layout: the first value in the low nibble."""
    flat = values.reshape(-1).view(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


@dataclass(frozen=True)
class Region:
    """Bytes ``[offset, offset + size)`` of the weight file."""

    offset: int
    size: int


@dataclass(frozen=True)
class ConstantSpec:
    region: Region
    element_type: str  # OpenVINO type name: f32 f16 u8 i8 u4 i4 i64
    shape: tuple[int, ...]
    name: str


def _as_bytes(chunk: np.ndarray) -> memoryview:
    return np.ascontiguousarray(chunk).data.cast("B")


class WeightFile:
    """An append-only scratch file of constants, mapped back by OpenVINO. Deleted by ``close``."""

    def __init__(self, path: Path, core: ov.Core | None = None):
        self.path = Path(path)
        self._xml = self.path.with_name(self.path.name + ".xml")
        self._file = self.path.open("wb")
        self._core = core or ov.Core()
        self._size = 0
        self._ids = itertools.count()

    @property
    def size(self) -> int:
        return self._size

    def write(self, chunks: Iterable[np.ndarray]) -> Region:
        """Append ``chunks`` (raw bytes in OpenVINO layout, in order) as one tensor's data."""
        pad = -self._size % _ALIGN
        if pad:
            self._file.write(b"\0" * pad)
            self._size += pad
        start = self._size
        for chunk in chunks:
            self._size += self._file.write(_as_bytes(chunk))
        return Region(start, self._size - start)

    def constants(self, specs: list[ConstantSpec]) -> list[ov.Node]:
        """``Constant`` nodes over the given regions, memory-mapped by OpenVINO."""
        for spec in specs:
            expected = packed_size(spec.element_type, spec.shape)
            if spec.region.size != expected:
                raise ValueError(f"{spec.name}: wrote {spec.region.size} bytes, {spec.element_type}"
                                 f"{list(spec.shape)} needs {expected}")
        self._file.flush()
        self._xml.write_text(_ir_of(specs, next(self._ids)), encoding="utf-8")
        model = self._core.read_model(str(self._xml), str(self.path))
        by_name = {r.get_friendly_name(): r.input_value(0).get_node() for r in model.get_results()}
        nodes = [by_name[f"out{i}"] for i in range(len(specs))]
        for node, spec in zip(nodes, specs, strict=True):
            node.set_friendly_name(spec.name)
        return nodes

    def close(self) -> None:
        """Close and delete the scratch files. Constants already made stay valid: the mapping
        outlives the directory entry, and the pages go when the last constant does."""
        if not self._file.closed:
            self._file.close()
        for path in (self.path, self._xml):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class MemoryConstants:
    """The :class:`WeightFile` interface over ordinary memory (each constant owns a copy)."""

    def __init__(self) -> None:
        self._blobs: list[bytes] = []

    def write(self, chunks: Iterable[np.ndarray]) -> Region:
        data = b"".join(bytes(_as_bytes(c)) for c in chunks)
        self._blobs.append(data)
        return Region(len(self._blobs) - 1, len(data))

    def constants(self, specs: list[ConstantSpec]) -> list[ov.Node]:
        nodes = []
        for spec in specs:
            data = self._blobs[spec.region.offset]
            tensor = ov.Tensor(_OV_TYPES[spec.element_type], list(spec.shape))
            view = np.frombuffer(data, np.uint8)
            if view.size != tensor.byte_size:
                raise ValueError(f"{spec.name}: wrote {view.size} bytes, needs {tensor.byte_size}")
            tensor.data.reshape(-1).view(np.uint8)[:] = view
            node = ov.op.Constant(tensor, shared_memory=False)
            node.set_friendly_name(spec.name)
            nodes.append(node)
            self._blobs[spec.region.offset] = b""
        return nodes

    def close(self) -> None:
        self._blobs.clear()


def _ir_of(specs: list[ConstantSpec], serial: int) -> str:
    """A minimal IR v11 whose Const layers point into the weight file, one Result each."""
    layers, edges = [], []
    for i, spec in enumerate(specs):
        dims = "".join(f"<dim>{d}</dim>" for d in spec.shape)
        precision = _PRECISION[spec.element_type]
        shape = ",".join(str(d) for d in spec.shape)
        layers.append(
            f'<layer id="{2 * i}" name="c{serial}_{i}" type="Const" version="opset1">'
            f'<data element_type="{spec.element_type}" shape="{shape}" offset="{spec.region.offset}" '
            f'size="{spec.region.size}"/><output><port id="0" precision="{precision}">{dims}</port></output></layer>'
        )
        layers.append(
            f'<layer id="{2 * i + 1}" name="out{i}" type="Result" version="opset1">'
            f'<input><port id="0" precision="{precision}">{dims}</port></input></layer>'
        )
        edges.append(f'<edge from-layer="{2 * i}" from-port="0" to-layer="{2 * i + 1}" to-port="0"/>')
    return (f'<?xml version="1.0"?>\n<net name="weights" version="11"><layers>{"".join(layers)}</layers>'
            f'<edges>{"".join(edges)}</edges></net>\n')
