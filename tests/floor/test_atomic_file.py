"""engine.atomic_file: the one temp-file-and-rename writer. A replaced file is 0600 from its first
byte (even over an existing 0644 file), holds exactly the bytes given, and a failed write leaves the
old file and no temporary beside it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from engine.atomic_file import write_bytes_atomic, write_json_atomic, write_text_atomic


def test_bytes_replace_a_file_and_leave_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "key.pem"
    write_bytes_atomic(path, b"first")
    write_bytes_atomic(path, b"\x00second\r\n")
    assert path.read_bytes() == b"\x00second\r\n"
    assert os.listdir(path.parent) == ["key.pem"]


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_the_new_file_is_private_even_over_a_public_one(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{}")
    os.chmod(path, 0o644)
    write_json_atomic(path, {"a": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"a": 1}


def test_text_is_utf8_with_newlines_as_written(tmp_path: Path) -> None:
    path = tmp_path / "note.txt"
    write_text_atomic(path, "héllo\nwörld\n")
    assert path.read_bytes() == "héllo\nwörld\n".encode()


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "book.json"
    write_text_atomic(path, "old")
    with pytest.raises(TypeError):
        write_bytes_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["book.json"]
