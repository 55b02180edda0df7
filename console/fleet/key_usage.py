"""Each API key's recent use, read from the tail of the API's audit log (``<state dir>/audit.jsonl``,
:mod:`engine.api.audit`): when it was last used, and its requests and tokens in what the tail
holds. The Keys page shows it beside every key. Pure over the lines; one bounded read of the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.api.audit import AUDIT_FILE

TAIL_BYTES = 2 << 20  # how much of the log's end is read: the recent past, at bounded cost


@dataclass(frozen=True)
class KeyUse:
    """One key's use in the lines read: ``last`` is the newest line's time (UTC, ISO 8601)."""

    last: str
    requests: int
    tokens: int

    def to_json(self) -> dict:
        return asdict(self)


def usage_of(lines: Iterable[str]) -> dict[str, KeyUse]:
    """Key name -> its use, over audit ``lines`` oldest first; lines that do not read (a cut first
    line, a stranger summary) are skipped."""
    out: dict[str, KeyUse] = {}
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        key = doc.get("key") if isinstance(doc, dict) else None
        if not isinstance(key, str) or doc.get("kind") == "strangers":
            continue
        tokens = int(doc.get("prompt_tokens") or 0) + int(doc.get("completion_tokens") or 0)
        seen = out.get(key)
        out[key] = KeyUse(str(doc.get("time", "")), (seen.requests if seen else 0) + 1,
                          (seen.tokens if seen else 0) + tokens)
    return out


def read_usage(state_dir: Path, tail_bytes: int = TAIL_BYTES) -> dict[str, KeyUse]:
    """The use of every key in the last ``tail_bytes`` of the audit log (none: no log yet)."""
    path = Path(state_dir) / AUDIT_FILE
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail_bytes))
            blob = f.read()
    except FileNotFoundError:
        return {}
    return usage_of(blob.decode("utf-8", errors="replace").splitlines())
