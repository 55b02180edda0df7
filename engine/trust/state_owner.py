"""Changing a service's state directory from a root shell without making its files root's.

``sudo deskfleet keys issue … --state-dir /var/lib/deskfleet`` used to write the key book as root:
the service (``DynamicUser=yes``) could then read it no more and refused every key. Worse, root
opening files by name inside a directory another user owns follows whatever links that user put
there. :func:`run_as_owner` runs such a change as the directory's owner instead: as root, when the
directory belongs to someone else, a child process enters the directory, drops to the owner's uid
and gid (no supplementary group), and does the work there by relative path; its answer (or its
error) comes back to the root process, which can still write what belongs to root (an admin's
certificate folder). Anyone else, or root on a directory of root's, runs the work in process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import DeskfleetError

MAX_ANSWER = 4 << 20


class StateOwnerError(DeskfleetError):
    """Work that had to run as the state directory's owner failed (the message says what and why)."""


def owner_of(state_dir: Path) -> tuple[int, int] | None:
    """The (uid, gid) to drop to: the directory's owner when this process is root and it is not
    (None: run as is; also when the directory does not exist yet)."""
    if os.name != "posix" or os.geteuid() != 0:
        return None
    try:
        st = os.stat(state_dir)
    except FileNotFoundError:
        return None
    return None if st.st_uid == 0 else (st.st_uid, st.st_gid)


def run_as_owner(state_dir: Path, work: Callable[[Path], Any], *, confine: bool = True) -> Any:
    """``work(dir)`` as the owner of ``state_dir`` (see the module docstring); its result must be
    JSON. ``dir`` is ``state_dir`` itself, or ``Path(".")`` inside the dropped child (whose
    parent directories the owner may not be allowed to cross: ``/var/lib/private``). ``confine``:
    the child's root is the state dir (chroot), so what opens files by absolute path (SQLite: the
    state database) reaches them, and nothing outside; without it, work that names the state dir
    by its real path (the keyring's account for the fleet CA) sees it. A DeskfleetError raised by
    ``work`` is raised again here with its message."""
    owner = owner_of(Path(state_dir))
    if owner is None:
        return work(Path(state_dir))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        code = 0
        try:
            os.chdir(state_dir)
            os.environ["HOME"] = "."  # as the service's unit has it (HOME=the state dir): never root's
            for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"):
                os.environ.pop(name, None)
            if confine:  # SQLite opens by absolute path; the owner may not cross the directories above
                os.chroot(".")
            os.setgroups([])
            os.setgid(owner[1])
            os.setuid(owner[0])
            answer: dict[str, Any] = {"result": work(Path("."))}
        except DeskfleetError as exc:
            answer, code = {"error": str(exc)}, 1
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            answer, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        try:
            with os.fdopen(write, "wb") as pipe:
                pipe.write(json.dumps(answer).encode()[:MAX_ANSWER])
        finally:
            os._exit(code)  # no atexit, no buffered output of the parent's written twice
    os.close(write)
    chunks = []
    with os.fdopen(read, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    os.waitpid(pid, 0)
    try:
        answer = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        answer = {}
    if "error" in answer:
        raise StateOwnerError(f"{answer['error']} (run as {state_dir}'s owner, uid {owner[0]})")
    if "result" not in answer:
        raise StateOwnerError(f"the change to {state_dir}, run as its owner (uid {owner[0]}), ended without "
                              "an answer")
    return answer["result"]
