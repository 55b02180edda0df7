"""``deskfleet keys``: the fleet's API keys, over a state directory (the fleet service's or console's).

    deskfleet keys issue NAME [--rpm N] [--tpm N] [--metrics] [--priority batch]   a new key (secret printed once)
    deskfleet keys list [--json]                    every key, live and revoked (never a secret)
    deskfleet keys revoke NAME                      the running API refuses it from its next request

The book is :class:`engine.trust.key_book.KeyBook` (``<state dir>/api-keys.json``, hashes only);
the service's admin API changes the same book. This command may run while the service runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.cli.main import Command
from engine.errors import DeskfleetError
from engine.trust.key_book import KeyBook
from engine.trust.state_owner import run_as_owner


def default_state_dir() -> Path:
    """The fleet's state directory when none is given: the per-user one the console and the fleet
    service use (``console.fleet_api.fleet_settings.default_state_dir``; a test keeps them equal)."""
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "Deskfleet" / "console"
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "deskfleet" / "console"


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("a limit is at least 1 (leave it out for no limit)")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the fleet service's state directory (default: the per-user one the console uses)")
    sub = p.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    issue = sub.add_parser("issue", help="issue a named key (a person or an application); prints its secret once")
    issue.add_argument("name", help="who holds it: alice, wiki-bot (letters, digits, . _ @ : -)")
    issue.add_argument("--rpm", type=_limit, default=None, metavar="N", help="at most N requests per minute")
    issue.add_argument("--tpm", type=_limit, default=None, metavar="N",
                       help="at most N tokens (prompt + answer) per minute")
    issue.add_argument("--priority", choices=("interactive", "batch"), default="interactive",
                       help="its class in a ring's fair share: interactive (chat, the default) or batch (served "
                            "after interactive keys when both wait, with a smaller share)")
    issue.add_argument("--metrics", action="store_true",
                       help="the key may read the API's /metrics (for a monitoring system; no other key may)")
    listing = sub.add_parser("list", help="every key: name, limits, issued, revoked (never a secret)")
    listing.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    revoke = sub.add_parser("revoke", help="revoke a key: the running API refuses it from its next request")
    revoke.add_argument("name")


def _table(keys: list[dict]) -> str:
    rows = [("NAME", "RPM", "TPM", "METRICS", "ISSUED", "REVOKED")]
    for k in keys:
        rows.append((k["name"], str(k.get("rpm") or "-"), str(k.get("tpm") or "-"), "yes" if k.get("metrics") else "-",
                     k["issued_at"], k.get("revoked_at") or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _change(args: argparse.Namespace, state_dir: Path) -> dict:
    """The action on the book in ``state_dir`` (run as the directory's owner: engine.trust.state_owner)."""
    book = KeyBook(state_dir)
    try:
        if args.keys_action == "issue":
            issued = book.issue(args.name, rpm=args.rpm, tpm=args.tpm, metrics=args.metrics, priority=args.priority)
            return {"secret": issued.secret}
        if args.keys_action == "list":
            return {"keys": [k.to_json() for k in book.keys()], "path": str(book.path)}
        return {"revoked": book.revoke(args.name).to_json()}
    except ValueError as exc:
        raise DeskfleetError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    """As root on a state dir another user owns (``sudo deskfleet keys … --state-dir /var/lib/deskfleet``)
    the book is changed as that owner, so the service can still read it (issue 29, L10)."""
    state_dir = args.state_dir or default_state_dir()
    answer = run_as_owner(state_dir, lambda where: _change(args, where))
    if args.keys_action == "issue":
        print(answer["secret"])
        print(f"key {args.name!r} issued; this is the only time its secret is shown: give it to its holder "
              "(they send it as 'Authorization: Bearer <key>')", file=sys.stderr)
    elif args.keys_action == "list":
        if args.json:
            print(json.dumps(answer["keys"], indent=1))
        else:
            print(_table(answer["keys"]) if answer["keys"] else f"no keys in {state_dir}")
    else:
        revoked = answer["revoked"]
        print(f"key {revoked['name']!r} revoked at {revoked['revoked_at']}", file=sys.stderr)
    return 0


COMMAND = Command(name="keys", help="issue, list and revoke the fleet's API keys", configure=configure, run=run)
