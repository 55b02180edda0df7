"""``deskfleet usage``: who used the fleet's API how much, from its state database (never a prompt).

    deskfleet usage [--by key|model|day|ring] [--since 7d|24h|2026-12-01] [--key NAME] [--json]

Each row adds up the requests of one key (a person or an application), model, ring or UTC day
since ``--since`` (default: 30 days): requests, errors, prompt and completion tokens, the mean time
to the first token and the mean duration. The same figures are the admin API's ``GET /usage``.
May run while the service runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from engine.api.usage import BY, DEFAULT_SINCE, parse_since, summary
from engine.cli.keys import default_state_dir
from engine.cli.main import Command
from engine.trust.state_owner import run_as_owner


def table(by: str, rows: list[dict]) -> str:
    head = (by.upper(), "REQUESTS", "ERRORS", "PROMPT", "COMPLETION", "TOTAL", "TTFT MS", "DURATION MS")
    lines = [head] + [(r["value"] or "-", str(r["requests"]), str(r["errors"]), str(r["prompt_tokens"]),
                       str(r["completion_tokens"]), str(r["total_tokens"]),
                       "-" if r["mean_ttft_ms"] is None else f"{r['mean_ttft_ms']:.0f}",
                       f"{r['mean_duration_ms']:.0f}") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the fleet service's state directory (default: the per-user one the console uses)")
    p.add_argument("--by", choices=BY, default="key", help="add up by key (default), model, UTC day or ring")
    p.add_argument("--since", default=DEFAULT_SINCE, help="an age (7d, 24h) or a UTC date (default: 30d)")
    p.add_argument("--key", default=None, metavar="NAME", help="one key's usage only")
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir or default_state_dir()
    since = parse_since(args.since)
    rows = run_as_owner(state_dir, lambda where: summary(where, args.by, since, args.key))
    if args.json:
        print(json.dumps({"by": args.by, "since": since, "rows": rows}, indent=1))
    elif rows:
        print(table(args.by, rows))
    else:
        print(f"no usage since {dt.datetime.fromtimestamp(since, dt.UTC):%Y-%m-%d %H:%M} UTC in {state_dir}",
              file=sys.stderr)
    return 0


COMMAND = Command(name="usage", help="the API's usage by key, model, day or ring (tokens, requests, latency)",
                  configure=configure, run=run)
