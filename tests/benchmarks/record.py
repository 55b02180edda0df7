"""Recording benchmark results: medians, a JSON file, and a section of docs/BENCHMARKS.md.

Every benchmark writes its raw runs to JSON and replaces its own marked section of the
Markdown file, so re-running one benchmark never disturbs another's table.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

DEFAULT_DOC = Path("docs") / "BENCHMARKS.md"
DEFAULT_JSON_DIR = Path("docs") / "bench"
_DOC_HEADER = (
    "# Benchmarks\n\n"
    "Every table below is written by the command shown with it; the raw runs are in the JSON file\n"
    "it names. These machines are shared and noisy (±10 %): compare the ratios inside one table,\n"
    "measured interleaved in one run, not absolute numbers across tables.\n"
)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def machine_info() -> dict[str, Any]:
    import openvino as ov

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "openvino": ov.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def update_section(doc: Path, name: str, body: str) -> Path:
    """Replace the ``<!-- name:start -->...<!-- name:end -->`` section of ``doc`` (append if new)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = doc.read_text(encoding="utf-8") if doc.is_file() else _DOC_HEADER
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        _, after = rest.split(end, 1)
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    tmp = doc.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, doc)
    return doc
