"""``deskfleet keys``: the fleet's API keys, over a state directory (the fleet service's or console's).

    deskfleet keys issue NAME [--rpm N] [--tpm N] [--metrics]   a new key; its secret is printed once
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


def default_state_dir() -> Path:
    """The fleet's state directory when none is given: the per-user one the console and the fleet
    service use (``console.service.console_settings.default_state_dir``; a test keeps them equal)."""
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
    issue.add_argument("--metrics", action="store_true",
                       help="the key may read the API's /metrics (for a monitoring system; no other key may)")
    listing = sub.add_parser("list", help="every key: name, limits, issued, revoked (never a secret)")
    listing.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    revoke = sub.add_parser("revoke", help="revoke a key: the running API refuses it from its next request")
    revoke.add_argument("name")


def _table(book: KeyBook) -> str:
    rows = [("NAME", "RPM", "TPM", "METRICS", "ISSUED", "REVOKED")]
    for k in book.keys():
        rows.append((k.name, str(k.rpm or "-"), str(k.tpm or "-"), "yes" if k.metrics else "-", k.issued_at,
                     k.revoked_at or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir or default_state_dir()
    book = KeyBook(state_dir)
    try:
        if args.keys_action == "issue":
            issued = book.issue(args.name, rpm=args.rpm, tpm=args.tpm, metrics=args.metrics)
            print(issued.secret)
            print(f"key {args.name!r} issued; this is the only time its secret is shown: give it to its holder "
                  "(they send it as 'Authorization: Bearer <key>')", file=sys.stderr)
        elif args.keys_action == "list":
            if args.json:
                print(json.dumps([k.to_json() for k in book.keys()], indent=1))
            else:
                print(_table(book) if book.keys() else f"no keys in {book.path}")
        else:
            revoked = book.revoke(args.name)
            print(f"key {revoked.name!r} revoked at {revoked.revoked_at}", file=sys.stderr)
    except ValueError as exc:
        raise DeskfleetError(str(exc)) from exc
    return 0


COMMAND = Command(name="keys", help="issue, list and revoke the fleet's API keys", configure=configure, run=run)
