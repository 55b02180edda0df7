"""Replacing a file so that a crash leaves either the old or the new one, never half of either.

Every file Deskfleet replaces (agent settings and state, the console's books and keys, the
join-token book, the file keyring, an admin's credentials, a shard store's manifest, an autostart
entry) goes through :func:`write_bytes_atomic`: a private temporary file in the same directory
(created 0600, ``O_EXCL``), fsync, then ``os.replace``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes, *, dir_mode: int = 0o777) -> None:
    """Replace ``path`` with ``data``, mode 0600 from the first byte (a fresh file, never an existing
    one whose mode O_TRUNC would keep); raises OSError (the old file is untouched) on failure."""
    path.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    # not tempfile.mkstemp: it makes the name absolute, and a process that entered a directory whose
    # parents it may not cross (engine.trust.state_owner) must keep to relative names
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_BINARY", 0), 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {path}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, *, dir_mode: int = 0o777) -> None:
    """:func:`write_bytes_atomic` of ``text`` in UTF-8 (newlines as written, on every OS)."""
    write_bytes_atomic(path, text.encode("utf-8"), dir_mode=dir_mode)


def write_json_atomic(path: Path, data: Any, *, indent: int = 2, sort_keys: bool = False,
                      dir_mode: int = 0o777) -> None:
    """:func:`write_text_atomic` of ``data`` as JSON (with a final newline)."""
    write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n", dir_mode=dir_mode)
