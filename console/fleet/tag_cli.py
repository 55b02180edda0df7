"""``deskfleet fleet tag``: an agent's tags, set by the admin through the running fleet service.

    deskfleet fleet tag                          list the members with their tags
    deskfleet fleet tag desk-7 --tags floor-2,finance
    deskfleet fleet tag desk-7 --reset           the agent's own tags (its --tags) count again

The agent is named by its name or the start of its node id. The call goes over the service's
local admin socket (``<state dir>/admin.sock``: whoever can read the state dir is its admin).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from typing import Any

from engine.errors import DeskfleetError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``deskfleet fleet tag``'s options (the agent is the ``name`` positional)."""
    p.add_argument("--tags", default=None, metavar="TAG,TAG",
                   help="tag: the admin's tags for the agent, comma-separated (e.g. floor-2,finance); they win "
                        "over the agent's own")
    p.add_argument("--reset", action="store_true",
                   help="tag: take the admin's tags away, so the agent's own (deskfleet agent --tags) count again")


def run_tag(args: argparse.Namespace) -> int:
    from console.fleet_api.fleet_settings import default_state_dir
    from engine.control.tags import tags_from_text

    if args.name is not None and args.tags is None and not args.reset:
        raise DeskfleetError(f"say what to do with {args.name}'s tags: --tags floor-2,finance to set them, "
                             "--reset to let the agent's own count again")
    if args.tags is not None and args.reset:
        raise DeskfleetError("--tags and --reset do not go together")
    tags = None if args.tags is None else tags_from_text(args.tags, "--tags")
    socket = (args.state_dir or default_state_dir()) / "admin.sock"
    for line in asyncio.run(_async_tag(socket, args.name, tags, args.reset)):
        print(line)
    return 0


def line(agent: Mapping[str, Any]) -> str:
    tags = ", ".join(agent.get("tags") or ()) or "(none)"
    by = " (set by the admin)" if agent.get("tags_set_by") == "admin" else ""
    return f"{agent['name']}  {str(agent.get('node_id', ''))[:12]}  {tags}{by}"


def find_agent(agents: list[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    """The member called ``name`` or whose node id starts with it; a named error otherwise."""
    members = [a for a in agents if a.get("membership") == "member" and a.get("node_id")]
    hits = [a for a in members if a["name"] == name] or [a for a in members if a["node_id"].startswith(name)]
    if len(hits) != 1:
        known = ", ".join(sorted(a["name"] for a in members)) or "none"
        what = "several agents match" if hits else "no member agent is called or has a node id starting with"
        raise DeskfleetError(f"{what} {name!r} (members: {known}); give the name or more of the node id")
    return hits[0]


async def _async_tag(socket, name: str | None, tags: tuple[str, ...] | None, reset: bool) -> list[str]:
    from console.fleet_api.admin_client import AdminClient

    async with AdminClient.over_socket(socket) as client:
        agents = (await client.async_call("GET", "/agents"))["agents"]
        if name is None:
            return [line(a) for a in agents if a.get("membership") == "member"] or ["no member agents"]
        agent = find_agent(agents, name)
        changed = await client.async_set_tags(agent["key"], None if reset else tags)
        return [line(changed)]
