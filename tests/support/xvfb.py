"""Real X11 rendering for the screenshot tests: Xvfb through ``xvfb-run``, when it works here."""

from __future__ import annotations

import shutil
import subprocess
import sys

XVFB = ["xvfb-run", "-a", "-s", "-screen 0 1280x800x24"]


def xvfb_works(env: dict[str, str]) -> bool:
    """True when xvfb-run and Xvfb are installed and a QApplication starts under them (Qt's xcb
    platform plugin loads); the screenshot tests fall back to offscreen otherwise."""
    if shutil.which("xvfb-run") is None or shutil.which("Xvfb") is None:
        return False
    probe = subprocess.run([*XVFB, sys.executable, "-c", "from PySide6.QtWidgets import QApplication; "
                            "QApplication([])"], env=env, capture_output=True, timeout=60)
    return probe.returncode == 0
