"""What the screenshot scripts share: real X11 rendering through ``xvfb-run`` when it works here,
and a wait that keeps Qt's events flowing (the scripts run outside pytest-qt)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

XVFB = ["xvfb-run", "-a", "-s", "-screen 0 1280x800x24"]


def xvfb_works(env: dict[str, str]) -> bool:
    """True when xvfb-run and Xvfb are installed and a QApplication starts under them (Qt's xcb
    platform plugin loads); the screenshot tests fall back to offscreen otherwise."""
    if shutil.which("xvfb-run") is None or shutil.which("Xvfb") is None:
        return False
    probe = subprocess.run([*XVFB, sys.executable, "-c", "from PySide6.QtWidgets import QApplication; "
                            "QApplication([])"], env=env, capture_output=True, timeout=60)
    return probe.returncode == 0


def qt_wait(app, condition, timeout: float, what: str) -> None:
    """Process ``app``'s events until ``condition()`` holds; TimeoutError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        app.processEvents()
        time.sleep(0.02)
    app.processEvents()
