"""Ending a child process the tests started: SIGTERM, then SIGKILL after a grace period."""

from __future__ import annotations

import signal
import subprocess


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End ``proc`` if it still runs: SIGTERM, and SIGKILL when it has not exited within ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
