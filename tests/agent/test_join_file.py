"""The silent install's token file on the agent: read strictly (what is wrong is said, the file
kept), a used file blanked where it may not be removed, and the tray joining a real console with
it. The joins against a real fleet service (failures kept and retried, the headless process
auto-approved) are in tests/fleet_service/test_join_tokens_service.py, on its shared service."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agent.service.join_file import (
    JoinFileError,
    consume,
    read_join_file,
)

pytestmark = pytest.mark.usefixtures("private_keyring")


def _token_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


async def _until(predicate, timeout: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := predicate()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
    return value


def test_the_file_is_read_strictly_and_said_what_is_wrong(tmp_path):
    from engine.trust.fleet_ca import FleetAuthority
    from engine.trust.join_token import JoinToken

    token = JoinToken.new(FleetAuthority.create("f").fingerprint).text
    assert read_join_file(tmp_path / "none") is None
    assert read_join_file(_token_file(tmp_path / "blank", "\n# used\n")) is None
    got = read_join_file(_token_file(tmp_path / "full", f"# from the installer\n{token}\nconsole=10.0.0.5:7411\n"))
    assert (got.token, got.console) == (token, "10.0.0.5:7411") and token not in repr(got)
    assert read_join_file(_token_file(tmp_path / "kv", f"token={token}\n")).console is None
    for name, text, mode, words in (
            ("typo", token[:-1] + ("A" if token[-1] != "A" else "B"), 0o600, "typo"),
            ("console", f"{token}\nconsole=nowhere\n", 0o600, "host:port"),
            ("garbage", f"{token}\nsomething else\n", 0o600, "does not understand"),
            ("only-console", "console=10.0.0.5:7411\n", 0o600, "no token"),
            ("open", f"{token}\n", 0o644, "chmod 600")):
        path = _token_file(tmp_path / name, text, mode)
        with pytest.raises(JoinFileError, match=words):
            read_join_file(path)
        assert path.read_text() == text  # kept for a person to look at


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root may remove a file from a read-only folder: nothing to blank")
def test_a_used_file_in_a_folder_the_agent_may_not_write_is_blanked(tmp_path):
    path = _token_file(tmp_path / "etc" / "join-token", "DFJ1-used\n")
    path.parent.chmod(0o500)
    try:
        consume(path)
        assert path.exists() and path.read_text() == ""
    finally:
        path.parent.chmod(0o700)


def test_the_tray_joins_with_the_installers_token_file_in_its_state_dir(tmp_path, start_tray, qtbot):
    """The Windows installer's path (``/TOKEN=`` writes ``join-token`` in the agent's state dir): the
    tray's bridge joins with it and the file is gone; the same call with nothing to join says so."""
    from agent.service.join_file import default_path
    from tests.support.agent_helpers import console
    from tests.support.asyncutil import held

    with held(lambda: console(tmp_path / "console")) as con:
        tray = start_tray()
        path = _token_file(default_path(tray.bridge.service.state_dir), f"{con.token()}\nconsole={con.enrollment}\n")
        outcomes: list[str] = []
        tray.bridge.join_from_file(path, None, on_result=outcomes.append)
        qtbot.waitUntil(lambda: len(outcomes) == 1, timeout=30_000)
        assert outcomes == ["joined"] and not path.exists() and tray.bridge.service.joined
        tray.bridge.join_from_file(path, None, on_result=outcomes.append)
        qtbot.waitUntil(lambda: len(outcomes) == 2, timeout=10_000)
        assert outcomes[1] == "already_joined"
