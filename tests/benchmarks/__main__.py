"""Deskfleet's benchmarks, run from a clone's root: ``python -m tests.benchmarks NAME [options]``.

Each benchmark is one module of this package with a ``COMMAND`` (its name, help, arguments and
``run``); it writes its raw runs to ``docs/bench/<name>.json`` and rewrites its own section of
``docs/BENCHMARKS.md`` (:mod:`tests.benchmarks.record`). None of this is installed: the wheel and
the .deb carry the product only. README.md here says how to add one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from engine.cli.main import run_parsed

PROG = "python -m tests.benchmarks"

# The name on the command line -> the module whose COMMAND runs it.
BENCHMARKS = {
    "agent": "tests.benchmarks.agent",
    "batching": "tests.benchmarks.batching",
    "console-fleet": "tests.benchmarks.console_fleet",
    "export-memory": "tests.benchmarks.export_memory",
    "failover": "tests.benchmarks.failover",
    "fairness": "tests.benchmarks.fairness",
    "fleet-scale": "tests.benchmarks.fleet_scale",
    "gguf-keep": "tests.benchmarks.gguf_keep",
    "grammar": "tests.benchmarks.grammar",
    "moe-export": "tests.benchmarks.moe_export",
    "npu": "tests.benchmarks.npu",
    "office": "tests.benchmarks.office",
    "office-big": "tests.benchmarks.office_big",
    "parity": "tests.benchmarks.parity",
    "pipeline": "tests.benchmarks.pipeline",
    "placement": "tests.benchmarks.placement",
    "placement-scale": "tests.benchmarks.placement_scale",
    "ring-model": "tests.benchmarks.ring_model",
    "rings": "tests.benchmarks.rings",
    "samplers": "tests.benchmarks.samplers",
    "shape-caches": "tests.benchmarks.shape_caches",
    "soak": "tests.benchmarks.soak",
    "speedups": "tests.benchmarks.speedups",
    "structured": "tests.benchmarks.structured",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every benchmark's parser, or with ``only`` just that one's (the others stay unimported)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run one of Deskfleet's benchmarks and record its JSON and its section of "
                    "docs/BENCHMARKS.md. Run from the root of a clone.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, module in BENCHMARKS.items():
        if only is not None and name != only:
            continue
        command = importlib.import_module(module).COMMAND
        bench = sub.add_parser(name, help=command.help, description=command.help)
        command.configure(bench)
        bench.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in argv if not a.startswith("-")]
    parser = build_parser(words[0] if words and words[0] in BENCHMARKS else None)
    return run_parsed(parser, parser.parse_args(argv), prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
