"""A small GGUF container reader: metadata as plain Python values, tensors as file offsets.

``gguf.GGUFReader`` keeps one numpy view per metadata array element: for a 50k-token
vocabulary that is ~150 MB of anonymous memory, more than the default model's whole INT4
stage, and it lasts as long as the reader. This parser keeps plain ``str``/``int``/``float``
lists (a few MB) and leaves tensor bytes in the file, to be read or mapped one tensor at a
time. The ``gguf`` package still supplies the type tables and the dequantisation.

Layout (GGUF v2/v3, little-endian): ``GGUF``, u32 version, u64 tensor count, u64 key count;
``key: string, u32 type, value`` pairs (arrays: u32 item type, u64 count, items); tensor infos
``name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 ggml type, u64 offset``; then the
data section at the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (wrong magic, version, or truncated)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) first
    type_id: int  # ggml type number (gguf.GGMLQuantizationType)
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a GGUF file: ``fields`` (key -> value) and ``tensors`` (in file order)."""

    def __init__(self, path: Path):
        # here: the gguf package (~1 s to import) loads only when a GGUF is opened
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with self.path.open("rb") as f:
            self._f = f
            self._pos = 0
            if self._read(4) != _MAGIC:
                raise GGUFFormatError(f"{self.path} does not start with the GGUF signature")
            (version,) = self._unpack("<I")
            if version not in (2, 3):
                raise GGUFFormatError(f"{self.path} is GGUF version {version}; versions 2 and 3 are supported "
                                      "(a big-endian GGUF reads as a huge version)")
            self.version = version
            tensor_count, kv_count = self._unpack("<QQ")
            self.fields: dict[str, Any] = {}
            for _ in range(kv_count):
                key = self._string()
                (kind,) = self._unpack("<I")
                self.fields[key] = self._value(kind)
            infos = []
            for _ in range(tensor_count):
                name = self._string()
                (n_dims,) = self._unpack("<I")
                dims = self._unpack(f"<{n_dims}Q")
                type_id, offset = self._unpack("<IQ")
                infos.append((name, tuple(int(d) for d in dims), int(type_id), int(offset)))
            alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
            data_start = self._pos + (-self._pos % alignment)
        size = self.path.stat().st_size
        self.tensors: list[TensorInfo] = []
        for name, dims, type_id, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError) as exc:
                raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {type_id}") from exc
            count = 1
            for d in dims:
                count *= d
            nbytes = count // block * type_size
            start = data_start + offset
            if start + nbytes > size:
                raise GGUFFormatError(f"{self.path} is truncated: tensor {name!r} ends past the file")
            self.tensors.append(TensorInfo(name, dims, type_id, start, nbytes))
        del self._f

    def _read(self, n: int) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise GGUFFormatError(f"{self.path} is truncated (header ends early)")
        self._pos += n
        return data

    def _unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return self._read(n).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                return list(struct.unpack(f"<{count}{fmt[1]}", self._read(count * struct.calcsize(fmt))))
            return [self._value(item) for _ in range(count)]
        raise GGUFFormatError(f"{self.path} has a metadata value of unknown type {kind}")
