"""Lazy, torch-free access to a checkpoint's tensors: one tensor (or row block) at a time.

A :class:`TensorSource` answers in HF names (``model.layers.0.self_attn.q_proj.weight``) and
float32, whatever the file holds. Two sources exist:

- an HF safetensors directory (config.json + ``*.safetensors``). The safetensors header is
  parsed here and tensors are read with positioned reads, so f32, f16 **and bf16** read the
  same way (``safe_open(framework="np")`` cannot return bf16) and only the rows asked for are
  read and widened;
- a ``.gguf`` file (:mod:`export.weights.gguf_source`), dequantised in numpy.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from export.weights.errors import CheckpointError


@runtime_checkable
class TensorSource(Protocol):
    """What the stage builder needs from a checkpoint."""

    config: dict  # HF config.json-style dict

    def names(self) -> frozenset[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> np.ndarray: ...  # float32, the whole tensor

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray: ...  # float32 rows [start, stop)


# safetensors dtype tag -> (numpy storage dtype, widen-to-f32 function)
def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32: shift the 16 bits into place and reinterpret.
    return (raw.astype(np.uint32) << 16).view(np.float32)


_DTYPES: dict[str, tuple[np.dtype, Callable[[np.ndarray], np.ndarray] | None]] = {
    "F32": (np.dtype("<f4"), None),
    "F16": (np.dtype("<f2"), None),
    "BF16": (np.dtype("<u2"), _bf16_to_f32),
    "F64": (np.dtype("<f8"), None),
}


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data section) of one ``.safetensors`` file."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path} is too short to be a safetensors file; copy it again")
        (size,) = struct.unpack("<Q", head)
        if size > 100 * 1024 * 1024:
            raise CheckpointError(f"{path} declares a {size}-byte header; the file is damaged")
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise CheckpointError(f"{path} has an unreadable safetensors header ({exc}); copy it again") from exc
    return header, 8 + size


class SafetensorsSource:
    """An HF checkpoint directory read through memory maps (no torch, no safe_open)."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        config_path = directory / "config.json"
        try:
            self.config: dict = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{config_path} is missing or not JSON ({exc}); "
                                  "pass an HF checkpoint directory") from exc
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory} has no *.safetensors files; is it an HF checkpoint directory?")
        self._entries: dict[str, _Entry] = {}
        for file in files:
            header, data_start = read_safetensors_header(file)
            file_size = file.stat().st_size
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self._entries:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self._entries[name].file.name} and {file.name}; "
                        "the directory mixes two checkpoints: remove the stray file")
                begin, end = (data_start + int(o) for o in info["data_offsets"])
                if end > file_size:
                    raise CheckpointError(f"{file} is truncated (tensor {name!r} ends past the file); copy it again")
                self._entries[name] = _Entry(file, str(info["dtype"]), tuple(int(d) for d in info["shape"]), begin, end)
        self._handles: dict[Path, io.BufferedReader] = {}

    def names(self) -> frozenset[str]:
        return frozenset(self._entries)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"checkpoint tensor {name!r} is missing; the checkpoint is incomplete") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        """The stored dtype tag (``F32``, ``F16``, ``BF16``...)."""
        return self._entry(name).dtype

    def _read_raw(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as stored (bf16 as uint16), read into fresh anonymous memory.

        ``pread`` rather than a memory map: mapped checkpoint pages would stay in this process's
        RSS until the file is closed, so a stage would hold all of its source tensors at once.
        """
        entry = self._entry(name)
        if entry.dtype not in _DTYPES:
            raise CheckpointError(
                f"tensor {name!r} is stored as {entry.dtype}; supported: {', '.join(_DTYPES)}. "
                "Re-save the checkpoint in float32, float16 or bfloat16")
        storage, _ = _DTYPES[entry.dtype]
        count = int(np.prod(entry.shape, dtype=np.int64))
        if (entry.end - entry.begin) != count * storage.itemsize:
            raise CheckpointError(f"tensor {name!r} has {entry.end - entry.begin} bytes but shape "
                                  f"{list(entry.shape)} of {entry.dtype}; the file is damaged")
        rows = entry.shape[0] if entry.shape else 1
        if not 0 <= start <= stop <= rows:
            raise CheckpointError(f"rows [{start}, {stop}) are outside tensor {name!r} of shape {list(entry.shape)}")
        row_values = count // rows if rows else 0
        out = np.empty((stop - start) * row_values, dtype=storage)
        handle = self._handles.get(entry.file)
        if handle is None:
            handle = self._handles[entry.file] = entry.file.open("rb")
        handle.seek(entry.begin + start * row_values * storage.itemsize)
        if handle.readinto(out.data.cast("B")) != out.nbytes:
            raise CheckpointError(f"{entry.file} ended early while reading {name!r}; copy it again")
        return out.reshape((stop - start, *entry.shape[1:]) if entry.shape else ())

    def read(self, name: str) -> np.ndarray:
        entry = self._entry(name)
        return self._widen(entry, self._read_raw(name, 0, entry.shape[0] if entry.shape else 1))

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._widen(self._entry(name), self._read_raw(name, start, stop))

    @staticmethod
    def _widen(entry: _Entry, raw: np.ndarray) -> np.ndarray:
        widen = _DTYPES[entry.dtype][1]
        out = widen(raw) if widen is not None else raw.astype(np.float32, copy=False)
        return np.ascontiguousarray(out, dtype=np.float32)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(path: Path) -> TensorSource:
    """A :class:`TensorSource` over an HF safetensors directory or a ``.gguf`` file."""
    path = Path(path)
    if path.is_dir():
        return SafetensorsSource(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        # here: the GGUF reader (and gguf, ~1 s to import) loads only for a .gguf
        from export.weights.gguf_source import GGUFSource

        return GGUFSource(path)
    raise CheckpointError(f"{path} is neither an HF checkpoint directory nor a .gguf file")
