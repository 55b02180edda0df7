"""JSON files in the fleet service's state dir: read with a clear error, replaced atomically.

A write goes to a temporary file in the same directory, is fsynced, and renamed over the old
file, so a crash never leaves half a file. A file that does not parse raises
`FleetStateError` and is left in place: nothing here ever overwrites what it could not read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from console.fleet.errors import FleetStateError
from engine.atomic_file import write_json_atomic


def read_json(path: Path, what: str) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when there is no such file. ``what`` names the file's
    purpose in the error ("the approved-agents list")."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise FleetStateError(f"cannot read {what} in {path}: {exc}; check the file's permissions, "
                                "or move it aside to start over") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FleetStateError(f"{what} in {path} is not valid JSON ({exc}); it was left in place: "
                                "restore it from a backup or move it aside to start over") from exc
    if not isinstance(data, dict):
        raise FleetStateError(f"{what} in {path} is not a JSON object; it was left in place: "
                                "restore it from a backup or move it aside to start over")
    return data


def read_agents(path: Path, what: str, fmt: int, lost: str) -> dict[str, Any]:
    """The ``agents`` object of a per-agent state file of format ``fmt`` ({} when there is no
    file); FleetStateError otherwise, the file left in place. ``lost`` says what moving the
    file aside costs ("the agents must then be approved again")."""
    data = read_json(path, what)
    if data is None:
        return {}
    agents = data.get("agents")
    if data.get("format") != fmt or not isinstance(agents, dict):
        raise FleetStateError(f"{what} in {path} is not format {fmt} with an 'agents' object; it was left "
                                f"in place: restore it from a backup or move it aside ({lost})")
    return agents


def write_json(path: Path, data: dict[str, Any], what: str) -> None:
    """Replace ``path`` with ``data`` atomically (temporary file, fsync, rename)."""
    try:
        write_json_atomic(path, data, sort_keys=True)
    except OSError as exc:
        raise FleetStateError(f"cannot write {what} to {path}: {exc}; check free disk space "
                                "and the state directory's permissions") from exc
