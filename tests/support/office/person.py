"""A person at a PC, emulated at the input device: ``xdotool`` sends key presses and pointer
motion to that PC's X server (the XTEST extension), exactly what a keyboard and mouse would
produce; the agent under test is never called. Its X11 idle source sees the input and its pause
policy decides as it would for a real person.
"""

from __future__ import annotations

import subprocess
import time

from tests.support.office.display import Display

XDOTOOL_TIMEOUT_S = 5.0


class PersonError(RuntimeError):
    """xdotool failed (its message is included)."""


class Person:
    """Someone sitting at ``display``'s PC."""

    def __init__(self, display: Display) -> None:
        self.display = display

    def _xdotool(self, *args: str) -> None:
        done = subprocess.run(["xdotool", *args], env={"DISPLAY": self.display.name, "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=XDOTOOL_TIMEOUT_S)
        if done.returncode != 0:
            raise PersonError(f"xdotool {' '.join(args)} on {self.display.name} failed: {done.stderr.strip()}")

    def nudge_mouse(self) -> None:
        self._xdotool("mousemove_relative", "--", "3", "2")
        self._xdotool("mousemove_relative", "--", "-3", "-2")

    def press(self, key: str = "shift") -> None:
        self._xdotool("key", key)

    def work(self, seconds: float, rate_hz: float = 5.0) -> int:
        """Type and move the mouse for ``seconds`` (as someone sitting down does): the input events sent."""
        sent = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.press()
            self.nudge_mouse()
            sent += 3
            time.sleep(1.0 / rate_hz)
        return sent
