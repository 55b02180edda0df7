"""``deskfleet models``: what models this PC has, getting more, and adding them to the fleet.

- ``deskfleet models``: the embedded default and the converted models (as before), then every model
  found in Ollama's, LM Studio's and the Hugging Face cache's stores on this PC, with its
  quantisation, size and whether this fleet can serve it (and why not).
- ``deskfleet models pull REPO [--file NAME | --quant Q4_K_M] [--revision R]``: from the hub, or the
  mirror ``HF_ENDPOINT`` names, into the hub's cache (:mod:`export.hub_pull`).
- ``deskfleet models add PATH | ollama:NAME[:TAG] | lmstudio:NAME | hf:REPO[/FILE]``: into the
  running fleet service's library (its admin socket in ``--state-dir``), without copying: a store's
  GGUF blob is linked under a readable name in Deskfleet's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

from engine.cli.main import Command
from engine.errors import DeskfleetError

ACTIONS = ("pull", "add")
LINKED_SUBDIR = "linked"


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_action", metavar="{pull,add}")
    pull = sub.add_parser("pull", help="download a model from the Hugging Face hub (or HF_ENDPOINT's mirror)")
    pull.add_argument("repo", help="the repository, e.g. Qwen/Qwen3-0.6B or bartowski/Llama-3.2-1B-Instruct-GGUF")
    choice = pull.add_mutually_exclusive_group()
    choice.add_argument("--file", default=None, metavar="NAME", help="the GGUF file to pull from a GGUF repository")
    choice.add_argument("--quant", default=None, metavar="Q",
                        help="the GGUF quantisation to pull, e.g. Q4_K_M (must name exactly one file)")
    pull.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    pull.add_argument("--quiet", action="store_true", help="no progress bar")
    add = sub.add_parser("add", help="add a model on this PC to the fleet service's library (no copy)")
    add.add_argument("model", help="a checkpoint directory, a .gguf file, or ollama:NAME[:TAG], lmstudio:NAME, "
                                   "hf:REPO[/FILE] (the names `deskfleet models` lists)")
    add.add_argument("--state-dir", type=Path, default=None,
                     help="the fleet service's state directory (default: the one `deskfleet fleet` uses)")


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "models_action", None)
    if action == "pull":
        return _pull(args)
    if action == "add":
        return _add(args)
    return _list()


def _list() -> int:
    from export.model_stores import find_models
    from export.sources import format_models_table, format_size, list_models

    print(format_models_table(list_models()))
    found = find_models()
    if not found:
        print("\nno models found in Ollama, LM Studio or the Hugging Face cache on this PC "
              "(get one with `deskfleet models pull REPO`)")
        return 0
    rows = [("FOUND", "QUANT", "SIZE", "SERVABLE", "ADD WITH")]
    for m in found:
        rows.append((m.ref, m.quant, format_size(m.size_bytes), "yes" if m.problem is None else f"no: {m.problem}",
                     f"deskfleet models add {m.ref}" if m.problem is None else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print()
    for r in rows:
        print("  ".join([*(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)), r[4]]).rstrip())
    return 0


def _pull(args: argparse.Namespace) -> int:
    from export.hub_pull import plan_pull, pull

    plan = plan_pull(args.repo, file=args.file, quant=args.quant, revision=args.revision)
    names = ", ".join(f.name for f in plan.files)
    print(f"pulling {plan.repo}@{plan.revision[:12]}: {names} ({plan.total_bytes / (1 << 20):.1f} MiB)",
          file=sys.stderr)
    local = pull(plan, progress=not args.quiet)
    print(local)
    print(f"verified. Add it to the fleet with: deskfleet models add {local}", file=sys.stderr)
    return 0


def _add(args: argparse.Namespace) -> int:
    from console.fleet_api.fleet_settings import default_state_dir

    path = local_path(args.model)
    socket_path = (args.state_dir or default_state_dir()) / "admin.sock"
    if not socket_path.exists():
        raise DeskfleetError(f"no fleet service runs with the state directory {socket_path.parent} (no admin "
                             "socket); start `deskfleet fleet` or `deskfleet console`, or pass --state-dir")
    entry = asyncio.run(_async_add(socket_path, path))
    print(f"added {entry.get('name')} ({entry.get('kind')}): {entry.get('path')}")
    return 0


async def _async_add(socket_path: Path, path: Path) -> dict:
    from console.fleet_api.admin_client import AdminClient

    async with AdminClient.over_socket(socket_path) as client:
        return await client.async_add_model(str(path))


def local_path(model: str) -> Path:
    """The path to add for ``model``: a path as given, or a store reference resolved (and, for a GGUF
    blob without a .gguf name, linked as ``<cache>/linked/<name>.gguf``)."""
    from export.model_stores import resolve_ref
    from export.sources import default_cache_root

    if not re.match(r"^(ollama|lmstudio|hf):", model):
        return Path(model).expanduser()
    found = resolve_ref(model)
    if found.problem is not None:
        raise DeskfleetError(f"{found.ref} cannot be served by this fleet: {found.problem}")
    if found.kind == "hf" or found.path.suffix.lower() == ".gguf":
        return found.path
    links = default_cache_root() / LINKED_SUBDIR
    links.mkdir(parents=True, exist_ok=True)
    link = links / (re.sub(r"[^A-Za-z0-9._-]+", "-", found.name).strip("-.") + ".gguf")
    if link.is_symlink() and link.resolve() != found.path.resolve():
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(found.path)
    return link


COMMAND = Command(name="models", help="list the models on this PC, pull one from the hub, add one to the fleet",
                  configure=configure, run=run)
