"""``deskfleet export`` run as a child whose memory a benchmark measures.

The exporter keeps no memory figures of its own; this wrapper does, around the CLI's own entry
point. It imports what an export imports, resets the kernel's peak-RSS mark (VmHWM, with
``clear_refs`` 5: ``ru_maxrss`` survives exec, so a child of a large parent would report the
parent's size), runs ``deskfleet <argv>``, and on success prints the one line the benchmarks
parse (:data:`PEAK_LINE`)::

    python -m tests.benchmarks.export_child [--wait] export MODEL --stages 2 --out DIR ...

With ``--wait`` it prints :data:`IMPORTED` once its imports are done and waits for a line on
stdin, so that the parent can read the child's RSS at that point first.
"""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Sequence
from pathlib import Path

IMPORTED = "deskfleet-bench: imported"
PEAK_LINE = re.compile(r"peak RSS (\d+) MB \(after imports (\d+) MB\)")


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> int:
    """This process's RSS in bytes, after resetting its peak-RSS mark where Linux allows it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    current = _status_kb("VmRSS")
    return current * 1024 if current is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak RSS in bytes since :func:`reset_peak_rss` (since exec elsewhere)."""
    peak = _status_kb("VmHWM")
    return peak * 1024 if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_line(peak: int, baseline: int) -> str:
    return f"peak RSS {peak / 1e6:.0f} MB (after imports {baseline / 1e6:.0f} MB)"


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    wait = argv[:1] == ["--wait"]
    if wait:
        argv = argv[1:]
    import openvino  # noqa: F401  (the export's imports, done before the baseline)

    import engine.cli.main
    import export.builder.export  # noqa: F401
    import export.cli  # noqa: F401
    import export.exporter  # noqa: F401

    if wait:
        print(IMPORTED, flush=True)
        sys.stdin.readline()  # the parent reads our RSS, then lets us go
    baseline = reset_peak_rss()
    code = engine.cli.main.main(argv)
    if code == 0:
        print(peak_line(peak_rss_bytes(), baseline), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
