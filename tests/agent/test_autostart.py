"""Start-at-login: generated contents for all three platforms, decoded by independent readers
(configparser + the Desktop Entry Exec rules, plistlib, the Microsoft argv rules), and real
enable/disable round trips into temporary directories (a fake winreg for Windows)."""

from __future__ import annotations

import plistlib
import re
from configparser import ConfigParser
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.tray.autostart import (
    LAUNCH_AGENT_LABEL,
    RUN_KEY,
    RUN_VALUE_NAME,
    AutostartError,
    desktop_entry,
    disable,
    enable,
    is_enabled,
    launch_agent_plist,
    windows_run_value,
)

AGENT = ["/opt/Desk Fleet/bin/deskfleet", "agent", "--tray"]
TRICKY = ["/home/ana/my \"apps\"/deskfleet", "agent", "--name=50% $HOME `x`", "C:\\dir\\", "",
          "a'b", "ünïcødé", "~", "#no-comment", "x;y|z&w", "(paren)"]


def parse_desktop(text: str) -> dict[str, str]:
    parser = ConfigParser(interpolation=None)
    parser.optionxform = str          # desktop keys are case-sensitive
    parser.read_string(text)
    return dict(parser["Desktop Entry"])


def parse_exec(value: str) -> list[str]:
    """The Desktop Entry reading of an Exec value: string escapes first, then quoting, then %%."""
    value = re.sub(r"\\([sntr\\])", lambda m: {"s": " ", "n": "\n", "t": "\t", "r": "\r",
                                                 "\\": "\\"}[m.group(1)], value)
    args: list[str] = []
    current: str | None = None
    i = 0
    while i < len(value):
        c = value[i]
        if c == " ":
            if current is not None:
                args.append(current)
            current = None
        elif c == '"':
            current = current or ""
            i += 1
            while value[i] != '"':
                if value[i] == "\\":
                    assert value[i + 1] in "\"`$\\", f"bad escape in {value!r}"
                    i += 1
                current += value[i]
                i += 1
        else:
            assert c not in "\"'\\><~|&;$*?#()`\t", f"unquoted reserved {c!r} in {value!r}"
            current = (current or "") + c
        i += 1
    if current is not None:
        args.append(current)
    for arg in args:
        assert not re.search(r"%[^%]|%$", arg.replace("%%", "")), f"field code in {arg!r}"
    return [a.replace("%%", "%") for a in args]


def parse_windows_command_line(line: str) -> list[str]:
    """The Microsoft C runtime's argv rules (2n backslashes + quote: n backslashes and a quote
    toggle; 2n+1: n backslashes and a literal quote; other backslashes are literal)."""
    args, current, quoted, have, i = [], "", False, False, 0
    while i < len(line):
        c = line[i]
        if c == "\\":
            n = len(line[i:]) - len(line[i:].lstrip("\\"))
            i += n
            if i < len(line) and line[i] == '"':
                current += "\\" * (n // 2)
                if n % 2:
                    current += '"'
                    i += 1
                have = True
                continue
            current += "\\" * n
            have = True
            continue
        if c == '"':
            quoted, have = not quoted, True
        elif c in " \t" and not quoted:
            if have:
                args.append(current)
            current, have = "", False
        else:
            current, have = current + c, True
        i += 1
    if have:
        args.append(current)
    return args


# -- generated contents ------------------------------------------------------------------------------

def test_desktop_entry_is_a_valid_autostart_entry():
    entry = parse_desktop(desktop_entry(AGENT))
    assert entry["Type"] == "Application" and entry["Terminal"] == "false"
    assert entry["X-GNOME-Autostart-enabled"] == "true" and "Hidden" not in entry
    assert entry["Exec"] == '"/opt/Desk Fleet/bin/deskfleet" agent --tray'
    assert parse_exec(entry["Exec"]) == AGENT


def test_desktop_exec_quotes_every_reserved_character():
    exec_value = parse_desktop(desktop_entry(TRICKY))["Exec"]
    assert "%%" in exec_value and "\\\\\\\\" in exec_value   # literal backslash: four in the file
    assert parse_exec(exec_value) == TRICKY


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=("Cc", "Cs")),
                        max_size=12), min_size=1, max_size=5).filter(lambda c: c[0] != ""))
def test_desktop_exec_round_trips_any_command(command):
    assert parse_exec(parse_desktop(desktop_entry(command))["Exec"]) == command


def test_launch_agent_plist():
    plist = plistlib.loads(launch_agent_plist(TRICKY))
    assert plist == {"Label": LAUNCH_AGENT_LABEL, "ProgramArguments": TRICKY, "RunAtLoad": True,
                     "ProcessType": "Interactive", "LimitLoadToSessionType": "Aqua"}


@pytest.mark.parametrize(("command", "value"), [
    ([r"C:\Program Files\Deskfleet\deskfleet.exe", "agent", "--tray"],
     r'"C:\Program Files\Deskfleet\deskfleet.exe" agent --tray'),
    ([r"C:\Deskfleet\deskfleet.exe", r"C:\my dir" + "\\"], r'C:\Deskfleet\deskfleet.exe "C:\my dir\\"'),
    (["deskfleet.exe", 'say "hi"', ""], r'deskfleet.exe "say \"hi\"" ""'),
])
def test_windows_run_value_quoting(command, value):
    assert windows_run_value(command) == value
    assert parse_windows_command_line(value) == command


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(st.sampled_from(list("ab \\\"'%&^|<>")), max_size=8), min_size=1,
                max_size=5).filter(lambda c: c[0] != ""))
def test_windows_run_value_round_trips_any_command(command):
    assert parse_windows_command_line(windows_run_value(command)) == command


@pytest.mark.parametrize("bad", [[], "deskfleet agent", [""], ["deskfleet", "two\nlines"], ["x\x7f"],
                                 ["deskfleet", 3]])
def test_unwritable_commands_are_refused(bad):
    for generate in (desktop_entry, launch_agent_plist, windows_run_value):
        with pytest.raises(AutostartError):
            generate(bad)


# -- enable / disable ----------------------------------------------------------------------------------

def test_xdg_enable_disable_round_trip(tmp_path):
    home, config = tmp_path / "home", tmp_path / "xdg-config"
    kw = dict(platform="linux", home=home, env={"XDG_CONFIG_HOME": str(config)})
    assert not is_enabled(**kw)
    where = enable(AGENT, **kw)
    path = config / "autostart" / "deskfleet-agent.desktop"
    assert where == str(path) and path.is_file()
    assert parse_exec(parse_desktop(path.read_text())["Exec"]) == AGENT
    assert is_enabled(**kw)
    enable(["/usr/bin/deskfleet", "agent"], **kw)                        # replaces, does not add
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    path.write_text(path.read_text() + "Hidden=true\n")                    # the desktop's "off"
    assert not is_enabled(**kw)
    assert disable(**kw) is True and not path.exists() and not is_enabled(**kw)
    assert disable(**kw) is False
    assert not (home / ".config").exists()


def test_xdg_ignores_a_relative_config_home(tmp_path):
    kw = dict(platform="linux", home=tmp_path, env={"XDG_CONFIG_HOME": "relative/dir"})
    assert enable(AGENT, **kw) == str(tmp_path / ".config" / "autostart" / "deskfleet-agent.desktop")


def test_macos_enable_disable_round_trip(tmp_path):
    kw = dict(platform="darwin", home=tmp_path)
    path = tmp_path / "Library" / "LaunchAgents" / f"{LAUNCH_AGENT_LABEL}.plist"
    assert enable(AGENT, **kw) == str(path)
    assert plistlib.loads(path.read_bytes())["ProgramArguments"] == AGENT and is_enabled(**kw)
    assert disable(**kw) and not path.exists() and not is_enabled(**kw)


class FakeWinreg:
    """The slice of ``winreg`` the autostart code uses, over a dict."""

    HKEY_CURRENT_USER, REG_SZ, KEY_SET_VALUE = "HKCU", 1, 2

    def __init__(self):
        self.keys: dict[tuple[str, str], dict[str, tuple[int, str]]] = {}

    @contextmanager
    def CreateKey(self, root, path):  # noqa: N802 (winreg's names)
        yield self.keys.setdefault((root, path), {})

    @contextmanager
    def OpenKey(self, root, path, reserved=0, access=0):  # noqa: N802
        if (root, path) not in self.keys:
            raise FileNotFoundError(path)
        yield self.keys[(root, path)]

    def SetValueEx(self, key, name, reserved, kind, value):  # noqa: N802
        key[name] = (kind, value)

    def QueryValueEx(self, key, name):  # noqa: N802
        if name not in key:
            raise FileNotFoundError(name)
        return key[name][1], key[name][0]

    def DeleteValue(self, key, name):  # noqa: N802
        if name not in key:
            raise FileNotFoundError(name)
        del key[name]


def test_windows_enable_disable_through_winreg():
    reg = FakeWinreg()
    kw = dict(platform="win32", winreg=reg)
    assert not is_enabled(**kw) and disable(**kw) is False
    command = [r"C:\Program Files\Deskfleet\deskfleet.exe", "agent"]
    assert enable(command, **kw) == rf"HKCU\{RUN_KEY}\{RUN_VALUE_NAME}"
    assert reg.keys[("HKCU", RUN_KEY)][RUN_VALUE_NAME] == (reg.REG_SZ, windows_run_value(command))
    assert is_enabled(**kw)
    assert disable(**kw) is True and not is_enabled(**kw)


def test_unknown_platform_is_a_clear_error(tmp_path):
    with pytest.raises(AutostartError, match="not supported on 'sunos5'"):
        enable(AGENT, platform="sunos5", home=tmp_path)
