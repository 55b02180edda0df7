"""The ``deskfleet`` command line.

Commands that live outside ``engine`` (export, models, the GUI shells) plug in through the
``deskfleet.commands`` entry-point group, so ``engine`` never imports them and a stage PC without
the export extra still gets a helpful message instead of an ImportError. The benchmarks are no
part of the product: they run from a clone, ``python -m tests.benchmarks``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points

from engine import __version__
from engine.errors import DeskfleetError, MissingExtraError

log = logging.getLogger("deskfleet")


@dataclass(frozen=True)
class Command:
    """A subcommand: ``configure`` adds its arguments, ``run`` returns the exit code."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _unavailable(name: str, exc: Exception) -> Command:
    def run(_: argparse.Namespace) -> int:
        raise MissingExtraError(
            f"`deskfleet {name}` is not available in this installation ({exc}). "
            "Install the export tools with: pip install 'deskfleet[export]'"
        )

    return Command(name=name, help=f"(unavailable: {exc})", configure=lambda p: None, run=run)


# Built-in subcommands by name -> module with a COMMAND. Loaded lazily: a long-running process
# such as the agent should not carry the imports of every other command (OpenVINO, scipy).
_BUILTINS = {"doctor": "engine.cli.doctor", "generate": "engine.cli.generate", "keys": "engine.cli.keys",
             "serve": "engine.cli.serve", "usage": "engine.cli.usage", "wan": "engine.cli.wan",
             "worker": "engine.cli.worker"}


def _plugins(group: str, only: str | None = None) -> list[Command]:
    commands = []
    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        if only is not None and ep.name != only:
            continue
        try:
            cmd = ep.load()
        except ImportError as exc:
            cmd = _unavailable(ep.name, exc)
        commands.append(cmd)
    return commands


def _builtin_commands(only: str | None = None) -> list[Command]:
    return [importlib.import_module(module).COMMAND for name, module in _BUILTINS.items()
            if only is None or name == only]


def _requested(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, if it is one we know without loading the rest."""
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        return None
    known = set(_BUILTINS) | {ep.name for ep in entry_points(group="deskfleet.commands")}
    return words[0] if words[0] in known else None


def _add(sub: argparse._SubParsersAction, cmd: Command) -> None:
    parser = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
    cmd.configure(parser)
    parser.set_defaults(_run=cmd.run)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` just that subcommand's parser (faster, lighter)."""
    parser = argparse.ArgumentParser(
        prog="deskfleet",
        description="Deskfleet: serve LLMs on a fleet of idle office PCs.",
    )
    parser.add_argument("--version", action="version", version=f"deskfleet {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in _builtin_commands(only) + _plugins("deskfleet.commands", only):
        _add(sub, cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_requested(argv))
    return run_parsed(parser, parser.parse_args(argv), prog="deskfleet")


def run_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace, *, prog: str) -> int:
    """Run the subcommand ``args`` chose (help and exit 2 when none): 1 with the message on a
    :class:`DeskfleetError`, 130 on Ctrl-C. Shared with the benchmarks' command line."""
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(run(args) or 0)
    except DeskfleetError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
