"""``deskfleet fleet tokens list|issue|revoke``: the fleet's join tokens from a shell, over the
running service's admin API (its local socket in ``--state-dir``, the local admin).

- ``tokens list``: every token the service keeps (no secrets): id, label, uses, used, left,
  expiry, auto-approve, state, the PCs it admitted.
- ``tokens issue [--uses N] [--ttl SECONDS|never] [--auto-approve] [--label TEXT]``: a new token;
  its text is printed once (the service keeps only its hash). ``--auto-approve`` needs an expiry.
  With ``--token-file PATH`` the text goes into a new 0600 file instead of the terminal (for a
  software-distribution tool to hand to ``deskfleet-agent``'s silent install).
- ``tokens revoke ID``: the token admits no PC from now on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

from console.fleet_api.token_rows import COLUMNS, token_rows

ACTIONS = ("list", "issue", "revoke")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tokens`` options (the sub-action and the token id are ``fleet_cli``'s positionals)."""
    p.add_argument("--uses", type=int, default=1,
                   help="tokens issue: how many PCs the token admits (default 1: a single PC)")
    p.add_argument("--ttl", default="86400", metavar="SECONDS|never",
                   help="tokens issue: seconds the token is valid (default 86400, a day; 'never': no expiry, "
                        "not with --auto-approve)")
    p.add_argument("--auto-approve", action="store_true",
                   help="tokens issue: approve every PC the token admits (the token must expire)")
    p.add_argument("--label", default="", help="tokens issue: a label shown in the list and the audit, e.g. 'floor 3'")
    p.add_argument("--token-file", type=Path, default=None, metavar="PATH",
                   help="tokens issue: write the token into this new 0600 file instead of printing it")
    p.add_argument("--json", action="store_true", help="tokens list/issue/revoke: print the service's JSON answer")


def parse_ttl(text: str) -> float | None:
    from engine.errors import DeskfleetError

    if text.strip().lower() in ("never", "none", "0"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise DeskfleetError(f"--ttl takes a number of seconds or 'never', not {text!r}") from None
    if not 0 < value < math.inf:  # NaN, inf and -inf parse as floats
        raise DeskfleetError(f"--ttl must be a positive, finite number of seconds (or 'never'), not {text!r}")
    return value


def run_tokens(args: argparse.Namespace, action: str | None, rest: list[str]) -> int:
    """Run ``tokens <action> [rest]``; prints the result, returns the exit code."""
    from console.fleet_api.fleet_settings import default_state_dir
    from engine.errors import DeskfleetError

    if action not in ACTIONS:
        raise DeskfleetError(f"say `deskfleet fleet tokens {'|'.join(ACTIONS)}` (got {action!r})")
    if action == "revoke" and len(rest) != 1:
        raise DeskfleetError("say which token: deskfleet fleet tokens revoke ID (the id from `tokens list`)")
    if action != "revoke" and rest:
        raise DeskfleetError(f"`tokens {action}` takes no further arguments (got {' '.join(rest)})")
    socket_path = (args.state_dir or default_state_dir()) / "admin.sock"
    answer = asyncio.run(_async_call(socket_path, action, args, rest))
    if args.json:
        print(json.dumps(answer, indent=1))
    elif action == "list":
        print(format_table(answer))
    elif action == "issue":
        info = answer["token_info"]
        expires = "never" if info["expires_at"] is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(
            info["expires_at"]))
        what = f"token {info['id']}: {info['uses']} use(s), expires {expires}" + (
            ", auto-approving" if info["auto_approve"] else "")
        if args.token_file is not None:
            print(f"{what}; written to {args.token_file} (0600)")
        else:
            print(f"{what}\n{answer['token']}\n(shown once: the service keeps only its hash)")
    else:
        print(f"token {answer['id']} is {answer['state']}")
    return 0


async def _async_call(socket_path: Path, action: str, args: argparse.Namespace, rest: list[str]) -> Any:
    from console.fleet_api.admin_client import AdminClient
    from engine.control.fleet_services import write_token_file

    async with AdminClient.over_socket(socket_path) as client:
        if action == "list":
            return await client.async_tokens()
        if action == "revoke":
            return await client.async_revoke_token(rest[0])
        answer = await client.async_issue_token(uses=args.uses, ttl_s=parse_ttl(args.ttl),
                                                auto_approve=args.auto_approve, label=args.label)
        if args.token_file is not None:
            write_token_file(args.token_file, answer["token"])
            answer = {**answer, "token": f"(in {args.token_file})"}
        return answer


def format_table(tokens: list[dict[str, Any]]) -> str:
    if not tokens:
        return "no join tokens; issue one with `deskfleet fleet tokens issue`"
    rows = [COLUMNS, *(r.cells for r in token_rows(tokens, time.time()))]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
