"""A PC's own display: one Xvfb per PC, so the agent's real X11 idle source (the screensaver
extension's idle time, agent.service.idle.X11Idle) reads what a person does at that PC alone.

The server picks a free display number itself (``-displayfd``), so PCs of parallel runs (and other
tests' ``xvfb-run -a``) never collide; it listens on its unix socket only (no TCP).
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import stop

START_TIMEOUT_S = 20.0


class DisplayError(RuntimeError):
    """Xvfb is missing or did not start (its log is named)."""


def why_unavailable() -> str | None:
    if shutil.which("Xvfb") is None:
        return "Xvfb is not installed (apt package xvfb; installer/bootstrap.sh installs it)"
    if shutil.which("xdotool") is None:
        return "xdotool is not installed (apt package xdotool; installer/bootstrap.sh installs it)"
    return None


@dataclass(frozen=True)
class Display:
    name: str  # ":N"
    pid: int

    @property
    def env(self) -> dict[str, str]:
        """What a process on this PC's desktop has (an X session, not Wayland)."""
        return {"DISPLAY": self.name, "XDG_SESSION_TYPE": "x11"}


def start_xvfb(log: Path, preexec: Callable[[], None] | None = None) -> tuple[subprocess.Popen, Display]:
    """Start an Xvfb (in the caller's cgroups if ``preexec`` joins them); its process and display."""
    read_end, write_end = os.pipe()
    with log.open("ab") as out:
        argv = ["Xvfb", "-displayfd", str(write_end), "-nolisten", "tcp", "-noreset", "-screen", "0", "640x480x24"]
        proc = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, pass_fds=(write_end,),
                                preexec_fn=preexec, start_new_session=True)
    os.close(write_end)
    try:
        number = b""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not number.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([read_end], [], [], max(0.0, left))
            chunk = os.read(read_end, 16) if ready else b""
            if not chunk:
                stop_xvfb(proc)
                raise DisplayError(f"Xvfb did not report its display in {START_TIMEOUT_S:g} s (log: {log})")
            number += chunk
    finally:
        os.close(read_end)
    return proc, Display(f":{int(number.strip())}", proc.pid)


def stop_xvfb(proc: subprocess.Popen) -> None:
    stop(proc, 5)
