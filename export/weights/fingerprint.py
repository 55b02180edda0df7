"""Model fingerprints from raw bytes: no torch, one bounded read at a time.

``checkpoint_fingerprint`` is :func:`export.sources.model_fingerprint`'s definition computed from
the safetensors files' own bytes (header parsed here), so it gives the same hex digest for the
same checkpoint: canonical config.json without the writer's transformers version, then for every
tensor sorted by name its ``name \\0 dtype \\0 [shape]`` and its stored bytes, each
length-prefixed. ``gguf_fingerprint`` hashes a GGUF file's bytes (its metadata and tensors, as
stored), under its own prefix so the two kinds never collide.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import BinaryIO

from export.weights.checkpoint import CheckpointError, read_safetensors_header

_CHUNK = 1 << 20
_CONFIG_KEYS_NOT_FINGERPRINTED = frozenset({"transformers_version"})


def _framed(digest, data: bytes) -> None:
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def checkpoint_fingerprint(directory: Path) -> str:
    """Hex sha256 of an HF safetensors checkpoint directory (see the module docstring)."""
    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory / 'config.json'} is missing or not JSON ({exc})") from exc
    for key in _CONFIG_KEYS_NOT_FINGERPRINTED:
        config.pop(key, None)
    digest = hashlib.sha256(b"deskfleet-fingerprint-v1\0")
    _framed(digest, json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    where: dict[str, tuple[Path, dict, int]] = {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no *.safetensors files")
    for file in files:
        header, data_start = read_safetensors_header(file)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in where:
                raise CheckpointError(f"tensor {name!r} is in both {where[name][0].name} and {file.name}; "
                                      "remove the stray file")
            where[name] = (file, info, data_start)
    handles: dict[Path, BinaryIO] = {}
    try:
        for name in sorted(where):
            file, info, data_start = where[name]
            _framed(digest, f"{name}\0{info['dtype']}\0{list(info['shape'])}".encode())
            begin, end = (data_start + int(o) for o in info["data_offsets"])
            digest.update((end - begin).to_bytes(8, "little"))
            handle = handles.get(file) or handles.setdefault(file, file.open("rb"))
            handle.seek(begin)
            left = end - begin
            while left:
                chunk = handle.read(min(_CHUNK, left))
                if not chunk:
                    raise CheckpointError(f"{file} ends inside tensor {name!r}; copy it again")
                digest.update(chunk)
                left -= len(chunk)
    finally:
        for handle in handles.values():
            handle.close()
    return digest.hexdigest()


def gguf_fingerprint(path: Path) -> str:
    """Hex sha256 of a GGUF file's bytes, prefixed so it never equals a checkpoint fingerprint."""
    digest = hashlib.sha256(b"deskfleet-fingerprint-gguf-v1\0")
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_fingerprint(path: Path) -> str:
    """The fingerprint of a checkpoint directory or a ``.gguf`` file."""
    path = Path(path)
    return checkpoint_fingerprint(path) if path.is_dir() else gguf_fingerprint(path)
