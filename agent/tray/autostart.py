"""Start the tray agent at login: an XDG autostart entry (Linux and other freedesktop
systems), a LaunchAgent (macOS), or a value under the Run key (Windows).

What gets written is produced by pure functions (`desktop_entry`, `launch_agent_plist`,
`windows_run_value`), tested on every platform; `enable`/`disable`/`is_enabled` only write,
delete or look for it. Per-user locations only: no administrator rights are needed, and an
employee can always turn it off again. The Linux package installs a system-wide XDG entry of
the same name (``/etc/xdg/autostart``); a person turns that one off with a per-user entry marked
``Hidden=true``, as the XDG autostart spec prescribes.

The tray's "Start at login" calls it at run time; the packages (:mod:`installer.deb`,
:mod:`installer.windows`) take its names and entry text when they are built, so both write the
same entry.
"""

from __future__ import annotations

import configparser
import os
import plistlib
import subprocess
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from configparser import ConfigParser
from pathlib import Path
from typing import Any

from engine.atomic_file import write_bytes_atomic
from engine.errors import DeskfleetError

APP_NAME = "Deskfleet agent"
DESKTOP_FILE = "deskfleet-agent.desktop"
LAUNCH_AGENT_LABEL = "org.deskfleet.agent"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
RUN_VALUE_NAME = "Deskfleet"

# Characters that force quoting of an Exec argument (Desktop Entry spec, "The Exec key"), and
# those that must be backslash-escaped inside the quotes.
_EXEC_RESERVED = frozenset(" \t\n\"'\\><~|&;$*?#()`")
_EXEC_ESCAPED = frozenset("\"`$\\")


class AutostartError(DeskfleetError):
    """Raised when start-at-login cannot be registered: an unsupported platform, a command that
    cannot be written into the registration (empty, control characters), or a failed write."""


def _check_command(command: Sequence[str]) -> list[str]:
    if isinstance(command, str) or not command or not all(isinstance(a, str) for a in command):
        raise AutostartError(f"the autostart command must be a non-empty list of arguments, "
                             f"got {command!r}")
    for arg in command:
        if any(unicodedata.category(c) == "Cc" for c in arg):
            raise AutostartError(f"the autostart argument {arg!r} holds a control character "
                                 "(newline, tab...), which no start-at-login format can carry")
    if not command[0]:
        raise AutostartError("the autostart command has an empty program name")
    return list(command)


def _exec_quote(arg: str) -> str:
    """One Exec argument: ``%`` doubled (field codes), quoted when it holds a reserved character."""
    arg = arg.replace("%", "%%")
    # Any whitespace (not only the spec's): readers strip a value's ends by their own notion.
    if arg and not _EXEC_RESERVED.intersection(arg) and not any(c.isspace() for c in arg):
        return arg
    return '"' + "".join("\\" + c if c in _EXEC_ESCAPED else c for c in arg) + '"'


def desktop_entry(command: Sequence[str]) -> str:
    """The XDG autostart ``.desktop`` file for ``command``.

    Exec is quoted by the Desktop Entry rules, then escaped once more as a string value (``\\``
    -> ``\\\\``): the spec applies the string escapes before the quoting rules, so a literal
    backslash inside a quoted argument is four backslashes in the file.
    """
    exec_line = " ".join(_exec_quote(a) for a in _check_command(command)).replace("\\", "\\\\")
    return ("[Desktop Entry]\n"
            "Type=Application\n"
            f"Name={APP_NAME}\n"
            "Comment=Lends this PC to the office LLM fleet while it is idle\n"
            f"Exec={exec_line}\n"
            "Terminal=false\n"
            "X-GNOME-Autostart-enabled=true\n")


def launch_agent_plist(command: Sequence[str]) -> bytes:
    """The LaunchAgent property list: run ``command`` at login, in the GUI (Aqua) session only,
    where a tray icon can appear."""
    return plistlib.dumps({
        "Label": LAUNCH_AGENT_LABEL,
        "ProgramArguments": _check_command(command),
        "RunAtLoad": True,
        "ProcessType": "Interactive",
        "LimitLoadToSessionType": "Aqua",
    })


def windows_run_value(command: Sequence[str]) -> str:
    """The Run key's value: one command line, quoted by the rules the Microsoft C runtime (and so
    Python's own ``sys.argv``) uses to split it again."""
    return subprocess.list2cmdline(_check_command(command))


def xdg_autostart_path(home: Path, env: Mapping[str, str]) -> Path:
    # The spec says a relative XDG_CONFIG_HOME is invalid and must be ignored.
    config = env.get("XDG_CONFIG_HOME", "")
    base = Path(config) if config and os.path.isabs(config) else home / ".config"
    return base / "autostart" / DESKTOP_FILE


def xdg_system_paths(env: Mapping[str, str]) -> list[Path]:
    """The system-wide autostart entries of this name, most important first ($XDG_CONFIG_DIRS)."""
    dirs = env.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    return [Path(d) / "autostart" / DESKTOP_FILE for d in dirs.split(":") if d and os.path.isabs(d)]


def _xdg_entry_on(path: Path) -> bool | None:
    """None: no such entry; else whether it starts the agent (``Hidden=true`` counts as off)."""
    if not path.is_file():
        return None
    entry = ConfigParser(interpolation=None, strict=False)
    try:
        entry.read(path, encoding="utf-8")
    except (OSError, UnicodeDecodeError, configparser.Error):  # an unreadable entry: desktops skip it too
        return False
    return entry.get("Desktop Entry", "Hidden", fallback="false").strip() != "true"


def _system_entry_on(env: Mapping[str, str]) -> bool:
    return next((on for on in map(_xdg_entry_on, xdg_system_paths(env)) if on is not None), False)


def launch_agent_path(home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / f"{LAUNCH_AGENT_LABEL}.plist"


def _kind(platform: str) -> str:
    if platform.startswith("win32"):
        return "windows"
    if platform.startswith("darwin"):
        return "macos"
    if platform.startswith(("linux", "freebsd", "openbsd", "netbsd", "dragonfly")):
        return "xdg"
    raise AutostartError(f"start at login is not supported on {platform!r}; start the agent "
                         "from your session's own startup settings")


def _write(path: Path, content: bytes) -> None:
    try:
        write_bytes_atomic(path, content)
    except OSError as e:
        raise AutostartError(f"could not write {path}: {e}") from e


def _registry(winreg: Any) -> Any:
    if winreg is not None:
        return winreg
    import winreg as real  # Windows only; never imported elsewhere

    return real


def enable(command: Sequence[str], *, platform: str = sys.platform, home: Path | None = None,
           env: Mapping[str, str] | None = None, winreg: Any = None) -> str:
    """Register ``command`` to start at login; replaces an earlier registration. Returns where
    it was registered (a file path, or the registry value). ``winreg`` is for tests."""
    kind = _kind(platform)
    home = Path.home() if home is None else home
    env = os.environ if env is None else env
    if kind == "xdg":
        path = xdg_autostart_path(home, env)
        _write(path, desktop_entry(command).encode())
        return str(path)
    if kind == "macos":
        path = launch_agent_path(home)
        _write(path, launch_agent_plist(command))
        return str(path)
    reg = _registry(winreg)
    value = windows_run_value(command)
    with reg.CreateKey(reg.HKEY_CURRENT_USER, RUN_KEY) as key:
        reg.SetValueEx(key, RUN_VALUE_NAME, 0, reg.REG_SZ, value)
    return rf"HKCU\{RUN_KEY}\{RUN_VALUE_NAME}"


def disable(*, platform: str = sys.platform, home: Path | None = None,
            env: Mapping[str, str] | None = None, winreg: Any = None) -> bool:
    """Remove the registration (or mask the system-wide one). Returns whether there was one."""
    kind = _kind(platform)
    home = Path.home() if home is None else home
    env = os.environ if env is None else env
    if kind in ("xdg", "macos"):
        path = xdg_autostart_path(home, env) if kind == "xdg" else launch_agent_path(home)
        if kind == "xdg" and _system_entry_on(env):
            # The package's system-wide entry stays; this user's hidden entry of the same name masks it.
            was_on = _xdg_entry_on(path) is not False
            _write(path, f"[Desktop Entry]\nType=Application\nName={APP_NAME}\nHidden=true\n".encode())
            return was_on
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise AutostartError(f"could not remove {path}: {e}") from e
        return True
    reg = _registry(winreg)
    try:
        with reg.OpenKey(reg.HKEY_CURRENT_USER, RUN_KEY, 0, reg.KEY_SET_VALUE) as key:
            reg.DeleteValue(key, RUN_VALUE_NAME)
    except FileNotFoundError:
        return False
    return True


def is_enabled(*, platform: str = sys.platform, home: Path | None = None,
               env: Mapping[str, str] | None = None, winreg: Any = None) -> bool:
    """Whether the agent is registered to start at login (an XDG entry marked ``Hidden=true``
    counts as off, as desktops treat it; with no per-user entry, the system-wide one decides)."""
    kind = _kind(platform)
    home = Path.home() if home is None else home
    env = os.environ if env is None else env
    if kind == "xdg":
        user = _xdg_entry_on(xdg_autostart_path(home, env))  # a user entry overrides the system's
        return user if user is not None else _system_entry_on(env)
    if kind == "macos":
        return launch_agent_path(home).is_file()
    reg = _registry(winreg)
    try:
        with reg.OpenKey(reg.HKEY_CURRENT_USER, RUN_KEY) as key:
            reg.QueryValueEx(key, RUN_VALUE_NAME)
    except FileNotFoundError:
        return False
    return True
