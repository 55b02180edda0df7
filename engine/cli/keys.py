"""``deskfleet keys``: the fleet's API keys, over a state directory (the fleet service's or console's).

    deskfleet keys issue NAME [--rpm N] [--tpm N] [--metrics] [--holder WHO] [--application]
                              [--group G] [--day-tokens N] [--month-tokens N] [--priority batch]
                                                    a new key; its secret is printed once
    deskfleet keys set NAME [same options]          change a live key's limits, budgets, holder or group
    deskfleet keys group G [--day-tokens N] [--month-tokens N]   the group's token budgets (none: no budget)
    deskfleet keys list [--json]                    every key, live and revoked (never a secret)
    deskfleet keys revoke NAME                      the running API refuses it from its next request
    deskfleet keys prune [--days N]                 forget keys revoked more than N days ago (default 90)

``--state-dir DIR`` goes before or after the action (the README writes it after). A directory
that holds no fleet (no fleet CA) is refused: a key issued there would work nowhere.

The book is :class:`engine.trust.key_book.KeyBook` (the state database in the state directory,
hashes only); the service's admin API changes the same book. This command may run while the
service runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.cli.main import Command
from engine.control.fleet_services import is_first_run
from engine.errors import DeskfleetError
from engine.trust.key_book import KEEP_REVOKED_DAYS, KeyBook
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


STATE_DIR_HELP = "the fleet service's state directory (default: the per-user one the console uses)"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help=STATE_DIR_HELP)
    sub = p.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    issue = sub.add_parser("issue", help="issue a named key (a person or an application); prints its secret once")
    issue.add_argument("name", help="who holds it: alice, wiki-bot (letters, digits, . _ @ : -)")
    issue.add_argument("--rpm", type=_limit, default=None, metavar="N", help="at most N requests per minute")
    issue.add_argument("--tpm", type=_limit, default=None, metavar="N",
                       help="at most N tokens (prompt + answer) per minute")
    issue.add_argument("--metrics", action="store_true",
                       help="the key may read the API's /metrics (for a monitoring system; no other key may)")
    _record_options(issue)
    change = sub.add_parser("set", help="change a live key's limits, budgets, holder or group (its secret stays)")
    change.add_argument("name")
    change.add_argument("--rpm", type=_limit, default=None, metavar="N", help="at most N requests per minute")
    change.add_argument("--tpm", type=_limit, default=None, metavar="N", help="at most N tokens per minute")
    _record_options(change)
    group = sub.add_parser("group", help="a group's token budgets (every key in it together)")
    group.add_argument("group")
    group.add_argument("--day-tokens", type=_limit, default=None, metavar="N", help="tokens per UTC day")
    group.add_argument("--month-tokens", type=_limit, default=None, metavar="N", help="tokens per UTC month")
    prune = sub.add_parser("prune", help="forget the keys revoked more than --days ago (the service does it daily)")
    prune.add_argument("--days", type=float, default=KEEP_REVOKED_DAYS, metavar="N",
                       help=f"keep revoked keys this many days (default {KEEP_REVOKED_DAYS})")
    listing = sub.add_parser("list", help="every key: name, limits, issued, revoked (never a secret)")
    listing.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    revoke = sub.add_parser("revoke", help="revoke a key: the running API refuses it from its next request")
    revoke.add_argument("name")
    for action in (issue, listing, revoke):  # after the action too; SUPPRESS keeps one given before it
        action.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS, help=STATE_DIR_HELP)


def _record_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--holder", default=None, metavar="WHO", help="the person (or application) the key is for")
    p.add_argument("--application", action="store_true", help="the holder is an application, not a person")
    p.add_argument("--group", default=None, metavar="G", help="the key's group (budgets and usage per group)")
    p.add_argument("--day-tokens", type=_limit, default=None, metavar="N", help="a budget of N tokens per UTC day")
    p.add_argument("--month-tokens", type=_limit, default=None, metavar="N",
                   help="a budget of N tokens per UTC month")
    p.add_argument("--priority", choices=("interactive", "batch"), default=None,
                   help="its class in a ring's fair share: interactive (chat, the default) or batch (served "
                        "after interactive keys when both wait, with a smaller share)")


def _record_fields(args: argparse.Namespace) -> dict:
    """The record options given (``set`` changes only those)."""
    given = {k: getattr(args, k) for k in ("holder", "group", "day_tokens", "month_tokens", "rpm", "tpm", "priority")
             if getattr(args, k, None) is not None}
    if args.application:
        given["holder_kind"] = "application"
    return given


def _table(keys: list[dict]) -> str:
    rows = [("NAME", "HOLDER", "GROUP", "RPM", "TPM", "DAY", "MONTH", "METRICS", "ISSUED", "REVOKED")]
    for k in keys:
        holder = k.get("holder") or "-"
        if k.get("holder") and k.get("holder_kind") == "application":
            holder += " (app)"
        rows.append((k["name"], holder, k.get("group") or "-", str(k.get("rpm") or "-"), str(k.get("tpm") or "-"),
                     str(k.get("day_tokens") or "-"), str(k.get("month_tokens") or "-"),
                     "yes" if k.get("metrics") else "-", k["issued_at"], k.get("revoked_at") or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _change(args: argparse.Namespace, state_dir: Path) -> dict:
    """The action on the book in ``state_dir`` (run as the directory's owner: engine.trust.state_owner)."""
    book = KeyBook(state_dir)
    try:
        if args.keys_action == "issue":
            issued = book.issue(args.name, metrics=args.metrics, **_record_fields(args))
            return {"secret": issued.secret}
        if args.keys_action == "set":
            return {"key": book.update(args.name, **_record_fields(args)).to_json()}
        if args.keys_action == "group":
            book.set_group_budget(args.group, day_tokens=args.day_tokens, month_tokens=args.month_tokens)
            return {"group": args.group}
        if args.keys_action == "prune":
            return {"pruned": list(book.prune_revoked(keep_days=args.days))}
        if args.keys_action == "list":
            return {"keys": [k.to_json() for k in book.keys()], "path": str(book.path)}
        return {"revoked": book.revoke(args.name).to_json()}
    except ValueError as exc:
        raise DeskfleetError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    """As root on a state dir another user owns (``sudo deskfleet keys … --state-dir /var/lib/deskfleet``)
    the book is changed as that owner, so the service can still read it (issue 29, L10)."""
    state_dir = args.state_dir or default_state_dir()
    if is_first_run(state_dir):
        raise DeskfleetError(f"{state_dir} holds no fleet (no fleet CA): a key issued there would work nowhere. "
                             "Give the fleet service's state directory with --state-dir (the one `deskfleet "
                             "console` or `deskfleet fleet run` uses)")
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
    elif args.keys_action == "set":
        print(f"key {args.name!r} changed", file=sys.stderr)
    elif args.keys_action == "group":
        budgets = ", ".join(f"{n} tokens per {p}" for n, p in ((args.day_tokens, "day"), (args.month_tokens, "month"))
                            if n) or "no budget"
        print(f"group {args.group!r}: {budgets}", file=sys.stderr)
    elif args.keys_action == "prune":
        print(f"{len(answer['pruned'])} revoked key(s) forgotten: {', '.join(answer['pruned']) or '-'}",
              file=sys.stderr)
    else:
        revoked = answer["revoked"]
        print(f"key {revoked['name']!r} revoked at {revoked['revoked_at']}", file=sys.stderr)
    return 0


COMMAND = Command(name="keys", help="issue, change, list, revoke and prune the fleet's API keys",
                  configure=configure, run=run)
