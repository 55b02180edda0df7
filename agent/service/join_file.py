"""Joining from a token file: the agent's half of a silent install.

A software-distribution tool installs the agent with a join token: the .deb takes it from a
debconf question or ``/etc/deskfleet/join-token`` (a root-only file the admin placed there) and
hands it to the system agent's own user as ``/var/lib/deskfleet-agent/join-token`` (0600, the
/etc copy removed), the Windows installer to ``join-token`` in the agent's state dir (``/TOKEN=`` or
``/TOKENFILE=``). The agent, when it has not joined yet, reads that file at start, joins with it,
and then removes it (or, where it may not remove it, blanks it): the token is not left lying
around once used. A failed join keeps the file and logs why; a refused token (used up,
expired, revoked, another fleet's, mistyped) is not tried again until the file changes, while a
console that cannot be reached is retried every ``RETRY_S``.

The file holds the token, and optionally the fleet service's enrolment address (without one the
console is found over mDNS)::

    DFJ1-...-...-....
    console=10.0.0.5:7411

Blank lines and ``#`` comments are ignored. On POSIX a file that other users may read is
refused (it is a secret): ``chmod 600`` it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from engine.control.enrollment import split_address
from engine.errors import DeskfleetError, JoinRefused, JoinTokenError
from engine.trust.fleet_ca import Credentials
from engine.trust.join_token import parse_token

log = logging.getLogger("deskfleet.agent.join_file")

FILE_NAME = "join-token"  # in the agent's state dir (the Windows installer writes it there)
RETRY_S = 60.0
MAX_FILE_BYTES = 4096


class JoinFileError(DeskfleetError):
    """The join-token file is unreadable, readable by other users, or does not hold a token (and,
    optionally, a ``console=HOST:PORT`` line); the file is kept as it is."""


class Joiner(Protocol):
    @property
    def joined(self) -> bool: ...

    async def async_join(self, console: str | None, token: str, *, timeout: float = ...) -> Credentials: ...


@dataclass(frozen=True)
class JoinFile:
    """What a join-token file says."""

    token: str = field(repr=False)
    console: str | None = None


def default_path(state_dir: Path) -> Path:
    return Path(state_dir) / FILE_NAME


def read_join_file(path: Path) -> JoinFile | None:
    """The file's token (and console); None when there is no file or it is blank (used up)."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JoinFileError(f"cannot read the join-token file {path} ({exc.strerror or exc}); the agent "
                            "reads it as the user it runs as (deskfleet-agent for the system service)") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise JoinFileError(f"the join-token file {path} is larger than {MAX_FILE_BYTES} bytes: not a token file")
    lines = [line.strip() for line in raw.decode("utf-8", "replace").splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        return None
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise JoinFileError(f"the join-token file {path} may be read by other users (mode "
                            f"{stat.S_IMODE(mode):04o}); it holds a secret: chmod 600 it (the installer writes it so)")
    token, console = None, None
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() == "console":
            console = value.strip() or None
        elif sep and key.strip().lower() == "token":
            token = value.strip()
        elif token is None and not sep:
            token = line
        else:
            raise JoinFileError(f"the join-token file {path} has a line it does not understand; it holds the token "
                                "and optionally console=HOST:PORT")
    if not token:
        raise JoinFileError(f"the join-token file {path} holds no token, only a fleet service address")
    try:
        parse_token(token)
        if console is not None:
            split_address(console)
    except (JoinTokenError, DeskfleetError) as exc:
        raise JoinFileError(f"the join-token file {path}: {exc}") from exc
    return JoinFile(token, console)


def consume(path: Path) -> None:
    """Remove the used file, or blank it where its folder may not be written (the token is spent)."""
    try:
        path.unlink()
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        log.info("cannot remove %s (%s); blanking it instead", path, exc.strerror or exc)
    try:
        with open(path, "r+b") as f:
            f.truncate(0)
    except OSError as exc:
        log.warning("cannot remove or blank the used join-token file %s (%s); remove it by hand", path,
                    exc.strerror or exc)


async def async_join_from_file(agent: Joiner, path: Path, *, console: str | None = None, timeout: float = 15.0) -> str:
    """One try: ``joined``, ``already_joined``, ``no_file``, or why it failed (``refused:<reason>``,
    ``bad_file``, ``unreachable``). ``console`` is the address to use when the file names none
    (None: found over mDNS). The file is consumed only after a successful join."""
    if agent.joined:
        return "already_joined"
    try:
        content = read_join_file(path)
    except JoinFileError as exc:
        log.error("%s", exc)
        return "bad_file"
    if content is None:
        return "no_file"
    address = content.console or console
    where = address or "the fleet service found on the network"
    try:
        creds = await agent.async_join(address, content.token, timeout=timeout)
    except JoinRefused as exc:
        log.error("the fleet service refused the token in %s (%s): %s; the file is kept; put a new token in it",
                  path, exc.reason, exc)
        return f"refused:{exc.reason}"
    except DeskfleetError as exc:
        log.warning("joining %s with the token in %s failed: %s; the file is kept, trying again in %.0f s",
                    where, path, exc, RETRY_S)
        return "unreachable"
    consume(path)
    log.info("joined fleet %s with the token in %s (now removed)", creds.fleet_id, path)
    return "joined"


async def async_keep_joining(agent: Joiner, path: Path, *, console: str | None = None, retry_s: float = RETRY_S,
                             timeout: float = 15.0) -> str:
    """Try until joined (or already joined, or no file); after a refusal or a bad file, wait for the
    file to change before trying again. Returns the final outcome; cancel it to stop."""
    last_refused: tuple[int, int] | None = None
    while True:
        signature = _signature(path)
        if last_refused is None or signature != last_refused:
            outcome = await async_join_from_file(agent, path, console=console, timeout=timeout)
            if outcome in ("joined", "already_joined", "no_file"):
                return outcome
            last_refused = signature if outcome.startswith("refused") or outcome == "bad_file" else None
        await asyncio.sleep(retry_s)


def _signature(path: Path) -> tuple[int, int] | None:
    with contextlib.suppress(OSError):
        st = path.stat()
        return st.st_mtime_ns, st.st_size
    return None
