"""How long since the person at this PC last touched the keyboard or mouse.

The pause policy (``agent.service.pause``) asks an `IdleSource` four times a second, on the
agent's event loop, so every source answers fast and never raises: ``None`` means "unknown"
(the policy then does not pause for use) and is what every source returns where its mechanism
is missing — another OS, no display, no logind, a library that will not load.

Sources, picked by `default_idle_source` from `SOURCES` (platform -> candidates, first answer
wins):
- Windows: ``GetLastInputInfo`` (user32) via ctypes.
- macOS: ``HIDIdleTime`` of IOHIDSystem, read with ``ioreg`` (a subprocess rather than IOKit
  through ctypes: a wrong ctypes signature would crash the tray, a failing ``ioreg`` cannot).
- Linux: the X11 screensaver extension (libX11 + libXss via ctypes) when an X display is set and
  the session is not Wayland (XWayland only sees input to X clients: it would report a person
  typing in a Wayland window as idle); else logind's ``IdleHint``/``IdleSinceHint``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)

_SUBPROCESS_TIMEOUT_S = 1.0


@runtime_checkable
class IdleSource(Protocol):
    def seconds_since_input(self) -> float | None:
        """Seconds since the last keyboard/mouse input; None when this source cannot tell."""


class FakeIdle:
    """A settable idle clock for tests: ``FakeIdle(5.0)``, then ``.seconds = 0.0`` on "input"."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = seconds

    def seconds_since_input(self) -> float | None:
        return self.seconds


class NoIdle:
    """Where no mechanism exists: always unknown."""

    def seconds_since_input(self) -> float | None:
        return None


class FirstAvailable:
    """Asks its sources in order and returns the first answer that is not None."""

    def __init__(self, sources: Sequence[IdleSource]) -> None:
        self.sources = tuple(sources)

    def seconds_since_input(self) -> float | None:
        for source in self.sources:
            seconds = source.seconds_since_input()
            if seconds is not None:
                return seconds
        return None


class WindowsIdle:
    """``GetLastInputInfo``: the tick count of the session's last input (wraps every 49.7 days,
    hence the modular difference with ``GetTickCount``)."""

    class _LastInputInfo(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint32)]

    def __init__(self) -> None:
        windll = getattr(ctypes, "windll", None)   # only exists on Windows
        self._user32 = getattr(windll, "user32", None)
        self._kernel32 = getattr(windll, "kernel32", None)
        if self._kernel32 is not None:
            self._kernel32.GetTickCount.restype = ctypes.c_uint32

    def seconds_since_input(self) -> float | None:
        if self._user32 is None or self._kernel32 is None:
            return None
        info = self._LastInputInfo(cbSize=ctypes.sizeof(self._LastInputInfo))
        if not self._user32.GetLastInputInfo(ctypes.byref(info)):
            return None
        return ((self._kernel32.GetTickCount() - info.dwTime) & 0xFFFFFFFF) / 1000.0


_HID_IDLE = re.compile(rb'"HIDIdleTime"\s*=\s*(\d+)')


def parse_hid_idle_time(ioreg_output: bytes) -> float | None:
    """Seconds from ``ioreg -c IOHIDSystem`` output (HIDIdleTime is in nanoseconds)."""
    match = _HID_IDLE.search(ioreg_output)
    return None if match is None else int(match.group(1)) / 1e9


def _run(command: Sequence[str]) -> bytes | None:
    """A helper command's stdout, or None if it is missing, fails or hangs."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, timeout=_SUBPROCESS_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("%s failed: %s", command[0], e)
        return None
    return done.stdout if done.returncode == 0 else None


class MacIdle:
    """``HIDIdleTime`` of the IOHIDSystem service, via ``ioreg``."""

    def seconds_since_input(self) -> float | None:
        out = _run(["ioreg", "-c", "IOHIDSystem", "-d", "4"])
        return None if out is None else parse_hid_idle_time(out)


class _XScreenSaverInfo(ctypes.Structure):
    _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int), ("kind", ctypes.c_int),
                ("til_or_since", ctypes.c_ulong), ("idle", ctypes.c_ulong),
                ("eventMask", ctypes.c_ulong)]


def _load(name: str) -> ctypes.CDLL | None:
    path = ctypes.util.find_library(name)
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


class X11Idle:
    """The X screensaver extension's idle time (ms since the last input to the X server).

    A display connection is opened per reading and closed at once: if the X server goes away
    (logout), Xlib's I/O error handler exits the process, so no connection is kept open between
    readings; ``XOpenDisplay`` on a dead display just returns NULL.
    """

    def __init__(self, display: str | None = None) -> None:
        self.display = display
        self._x11 = _load("X11")
        self._xss = _load("Xss")
        if self._x11 is not None and self._xss is not None:
            x11, xss = self._x11, self._xss
            x11.XOpenDisplay.argtypes = [ctypes.c_char_p]
            x11.XOpenDisplay.restype = ctypes.c_void_p
            x11.XCloseDisplay.argtypes = [ctypes.c_void_p]
            x11.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
            x11.XDefaultRootWindow.restype = ctypes.c_ulong
            xss.XScreenSaverQueryExtension.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                                       ctypes.POINTER(ctypes.c_int)]
            xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong,
                                                  ctypes.POINTER(_XScreenSaverInfo)]

    @property
    def available(self) -> bool:
        return self._x11 is not None and self._xss is not None

    def seconds_since_input(self) -> float | None:
        display = self.display if self.display is not None else os.environ.get("DISPLAY")
        x11, xss = self._x11, self._xss
        if not display or x11 is None or xss is None:
            return None
        dpy = x11.XOpenDisplay(display.encode())
        if not dpy:
            return None
        try:
            event_base, error_base = ctypes.c_int(), ctypes.c_int()
            if not xss.XScreenSaverQueryExtension(dpy, ctypes.byref(event_base),
                                                  ctypes.byref(error_base)):
                return None
            info = _XScreenSaverInfo()
            if not xss.XScreenSaverQueryInfo(dpy, x11.XDefaultRootWindow(dpy), ctypes.byref(info)):
                return None
            return info.idle / 1000.0
        finally:
            x11.XCloseDisplay(dpy)


def parse_logind_idle(output: bytes, now_us: int) -> float | None:
    """Seconds idle from ``loginctl show-session -p IdleHint -p IdleSinceHint`` output.

    logind only knows what the desktop tells it: ``IdleHint=yes`` once the desktop's own idle
    delay has passed, with ``IdleSinceHint`` (µs, wall clock) when that happened. So "no" reads
    as 0 s (the person may be there: do not take the PC), and "yes" as the time since the hint,
    which undercounts by the desktop's delay — both err on the side of the person.
    """
    values = dict(line.split("=", 1) for line in output.decode("utf-8", "replace").splitlines()
                  if "=" in line)
    hint = values.get("IdleHint")
    if hint == "no":
        return 0.0
    since = values.get("IdleSinceHint", "")
    if hint != "yes" or not since.isdigit() or int(since) == 0:
        return None
    return max(0.0, (now_us - int(since)) / 1e6)


class LogindIdle:
    """systemd-logind's idle hint for this session (``$XDG_SESSION_ID``, else the caller's)."""

    RETRY_S = 30.0  # without a logind session, ask again this rarely: each ask is a subprocess

    def __init__(self, session: str | None = None) -> None:
        self.session = session
        self._quiet_until = 0.0

    def seconds_since_input(self) -> float | None:
        if time.monotonic() < self._quiet_until:
            return None
        session = self.session or os.environ.get("XDG_SESSION_ID") or "self"
        out = _run(["loginctl", "show-session", session, "-p", "IdleHint", "-p", "IdleSinceHint"])
        seconds = None if out is None else parse_logind_idle(out, time.time_ns() // 1000)
        if seconds is None:
            self._quiet_until = time.monotonic() + self.RETRY_S
        return seconds


def _linux_sources(env: Mapping[str, str]) -> list[IdleSource]:
    wayland = bool(env.get("WAYLAND_DISPLAY")) or env.get("XDG_SESSION_TYPE") == "wayland"
    sources: list[IdleSource] = []
    if env.get("DISPLAY") and not wayland:
        sources.append(X11Idle(env["DISPLAY"]))
    sources.append(LogindIdle(env.get("XDG_SESSION_ID")))
    return sources


# Platform (``sys.platform`` prefix) -> the candidate sources there, best first.
SOURCES: Mapping[str, Callable[[Mapping[str, str]], list[IdleSource]]] = {
    "win32": lambda env: [WindowsIdle()],
    "darwin": lambda env: [MacIdle()],
    "linux": _linux_sources,
}


def default_idle_source(platform: str | None = None,
                        env: Mapping[str, str] | None = None) -> IdleSource:
    """The idle source for this PC: one source, a `FirstAvailable` chain, or `NoIdle`."""
    platform = sys.platform if platform is None else platform
    env = os.environ if env is None else env
    factory = next((f for key, f in SOURCES.items() if platform.startswith(key)), None)
    sources = factory(env) if factory is not None else []
    if not sources:
        return NoIdle()
    return sources[0] if len(sources) == 1 else FirstAvailable(sources)
