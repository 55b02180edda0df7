"""Idle sources: the per-platform selection, and that each real source answers None (never
raises) where its mechanism is missing. The X11 source runs against a real Xvfb when installed;
loginctl and ioreg run as real subprocesses, played by small scripts on PATH."""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.service.idle import (
    FakeIdle,
    FirstAvailable,
    IdleSource,
    LogindIdle,
    MacIdle,
    NoIdle,
    WindowsIdle,
    X11Idle,
    default_idle_source,
    parse_hid_idle_time,
    parse_logind_idle,
)


def test_fake_idle_is_settable():
    fake = FakeIdle(12.5)
    assert isinstance(fake, IdleSource) and fake.seconds_since_input() == 12.5
    fake.seconds = None
    assert fake.seconds_since_input() is None


def test_first_available_returns_the_first_known_answer():
    assert FirstAvailable([FakeIdle(None), FakeIdle(3.0), FakeIdle(9.0)]).seconds_since_input() == 3.0
    assert FirstAvailable([FakeIdle(None), NoIdle()]).seconds_since_input() is None


@pytest.mark.parametrize(("platform", "env", "expected"), [
    ("win32", {}, [WindowsIdle]),
    ("darwin", {"DISPLAY": ":0"}, [MacIdle]),
    ("linux", {"DISPLAY": ":0"}, [X11Idle, LogindIdle]),
    ("linux", {"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, [LogindIdle]),
    ("linux", {"DISPLAY": ":0", "XDG_SESSION_TYPE": "wayland"}, [LogindIdle]),
    ("linux", {}, [LogindIdle]),
    ("freebsd14", {"DISPLAY": ":0"}, [NoIdle]),
])
def test_selection_by_platform_and_session(platform, env, expected):
    source = default_idle_source(platform, env)
    chain = source.sources if isinstance(source, FirstAvailable) else (source,)
    assert [type(s) for s in chain] == expected


def test_selection_passes_the_display_and_session_on():
    chain = default_idle_source("linux", {"DISPLAY": ":5", "XDG_SESSION_ID": "c7"}).sources
    assert chain[0].display == ":5" and chain[1].session == "c7"


def test_windows_source_is_none_off_windows_and_handles_tick_wraparound(monkeypatch):
    if sys.platform != "win32":
        assert WindowsIdle().seconds_since_input() is None

    def get_last_input_info(ref):
        ref._obj.dwTime = 0xFFFF_FF00   # the last input: just before the 49.7-day wrap
        return 1

    def get_tick_count():
        return 0x100                    # now: just after it

    windll = SimpleNamespace(user32=SimpleNamespace(GetLastInputInfo=get_last_input_info),
                             kernel32=SimpleNamespace(GetTickCount=get_tick_count))
    monkeypatch.setattr(ctypes, "windll", windll, raising=False)
    assert WindowsIdle().seconds_since_input() == pytest.approx(0.512)


def test_x11_source_is_none_without_a_reachable_display(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    assert X11Idle().seconds_since_input() is None
    assert X11Idle(":93").seconds_since_input() is None      # nothing listens there


def write_tool(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


@pytest.fixture
def fake_path(tmp_path, monkeypatch):
    """An otherwise empty PATH holding only the tools a test writes into it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def test_logind_and_mac_sources_are_none_without_their_tools(fake_path):
    assert LogindIdle().seconds_since_input() is None
    assert MacIdle().seconds_since_input() is None


def test_logind_source_reads_loginctl(fake_path):
    since_us = time.time_ns() // 1000 - 90_000_000
    write_tool(fake_path, "loginctl", f'[ "$2" = c7 ] || exit 1\n'
                                      f'echo IdleHint=yes\necho IdleSinceHint={since_us}')
    assert LogindIdle("c7").seconds_since_input() == pytest.approx(90, abs=5)
    assert LogindIdle("other").seconds_since_input() is None     # loginctl exits 1


def test_a_hanging_tool_times_out_to_none(fake_path):
    write_tool(fake_path, "ioreg", "exec sleep 60")
    started = time.monotonic()
    assert MacIdle().seconds_since_input() is None
    assert time.monotonic() - started < 30  # given up on (after its timeout), not waited for: a hang guard


def test_mac_source_reads_ioreg(fake_path):
    write_tool(fake_path, "ioreg", """echo '    | |   "HIDIdleTime" = 4250000000'""")
    assert MacIdle().seconds_since_input() == 4.25


def test_parse_hid_idle_time():
    sample = (b'+-o IOHIDSystem  <class IOHIDSystem, id 0x100000>\n'
              b'  |   "HIDIdleTimeDelta" = 7\n  |   "HIDIdleTime" = 1500000000\n')
    assert parse_hid_idle_time(sample) == 1.5
    assert parse_hid_idle_time(b'"HIDIdleTime" = -3') is None
    assert parse_hid_idle_time(b"") is None


@pytest.mark.parametrize(("output", "expected"), [
    (b"IdleHint=yes\nIdleSinceHint=1000000000\n", 10.0),    # now is 1_010_000_000 us
    (b"IdleHint=no\nIdleSinceHint=1000000000\n", 0.0),      # the desktop says: someone is here
    (b"IdleHint=yes\nIdleSinceHint=0\n", None),
    (b"IdleHint=yes\nIdleSinceHint=2000000000\n", 0.0),     # clock stepped back: not negative
    (b"IdleHint=maybe\n", None),
    (b"garbage \xff\n", None),
])
def test_parse_logind_idle(output, expected):
    assert parse_logind_idle(output, now_us=1_010_000_000) == expected


# -- a real X server --------------------------------------------------------------------------------

def _free_display() -> int:
    for n in range(120, 200):
        if not Path(f"/tmp/.X11-unix/X{n}").exists() and not Path(f"/tmp/.X{n}-lock").exists():
            return n
    pytest.skip("no free X display number")


@pytest.fixture
def xvfb():
    """A private Xvfb; ``-noreset`` because an X server resets (idle time too) whenever its last
    client disconnects, and the source connects only for each reading."""
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed")
    n = _free_display()
    proc = subprocess.Popen(["Xvfb", f":{n}", "-noreset", "-nolisten", "tcp"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/tmp/.X11-unix/X{n}").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "Xvfb did not start"
            time.sleep(0.05)
        yield f":{n}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _simulate_input(display: str) -> None:
    """``XResetScreenSaver`` resets the server's input idle timer, as a key press would."""
    x11 = ctypes.CDLL(ctypes.util.find_library("X11"))
    x11.XOpenDisplay.argtypes, x11.XOpenDisplay.restype = [ctypes.c_char_p], ctypes.c_void_p
    for name in ("XResetScreenSaver", "XCloseDisplay"):
        getattr(x11, name).argtypes = [ctypes.c_void_p]
    x11.XSync.argtypes = [ctypes.c_void_p, ctypes.c_int]
    dpy = x11.XOpenDisplay(display.encode())
    assert dpy
    x11.XResetScreenSaver(dpy)
    x11.XSync(dpy, 0)
    x11.XCloseDisplay(dpy)


def test_x11_source_on_a_real_display(xvfb):
    source = default_idle_source("linux", {"DISPLAY": xvfb})
    first, read_first = source.seconds_since_input(), time.monotonic()
    assert first is not None
    time.sleep(1.0)
    second, read_second = source.seconds_since_input(), time.monotonic()
    # idle time grows with no input, as the clock does between the two reads (however late we ran)
    assert second - first == pytest.approx(read_second - read_first, abs=0.3)
    touched = time.monotonic()
    _simulate_input(xvfb)
    after = source.seconds_since_input()
    assert after <= time.monotonic() - touched + 0.1 and after < second  # the input reset it
