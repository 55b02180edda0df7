"""The agent's tags: in its settings (validated, normalised, saved), from ``deskfleet agent
--tags`` (laid over the saved settings, '' clears them, a bad tag a clear error before anything
is written), in its status (to_dict/from_dict, an older agent's status without them still
reads). The service's side is tests/console/test_agent_tags.py."""

from __future__ import annotations

import argparse
import json

import pytest

from agent.cli import command_line_tags, configure
from agent.service.settings import SETTINGS_FILE, AgentSettings, SettingsError, load_settings, resolve_settings
from engine.control.messages import AgentStatus
from engine.errors import TagError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_settings_keep_tags_normalised_and_refuse_bad_ones(tmp_path):
    assert AgentSettings(tags=("Floor-2", "finance", "finance")).tags == ("finance", "floor-2")
    with pytest.raises(SettingsError, match="'floor 2' is not a tag"):
        AgentSettings(tags=("floor 2",))
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({"name": "pc", "tags": ["lab", "Dept=IT"]}))
    assert load_settings(tmp_path).tags == ("dept=it", "lab")
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({"name": "pc", "tags": ["ok", "not ok"]}))
    with pytest.raises(SettingsError, match=SETTINGS_FILE):
        load_settings(tmp_path)


def test_the_command_line_sets_saves_and_clears_tags(tmp_path):
    _, first = resolve_settings(tmp_path, tags=command_line_tags(_args("--tags", "floor-2, finance")))
    assert first.tags == ("finance", "floor-2")
    assert json.loads((tmp_path / SETTINGS_FILE).read_text())["tags"] == ["finance", "floor-2"]
    _, kept = resolve_settings(tmp_path, tags=command_line_tags(_args()))  # not given: the saved ones
    assert kept.tags == ("finance", "floor-2") and command_line_tags(_args()) is None
    _, cleared = resolve_settings(tmp_path, tags=command_line_tags(_args("--tags", "")))
    assert cleared.tags == () and load_settings(tmp_path).tags == ()
    before = (tmp_path / SETTINGS_FILE).read_text()
    with pytest.raises(TagError, match="--tags: 'fl@or' is not a tag"):
        command_line_tags(_args("--tags", "fl@or"))
    assert (tmp_path / SETTINGS_FILE).read_text() == before


def test_the_status_carries_the_tags_and_an_older_status_reads_without_them():
    from engine.control.messages import FetchProgress, WorkerStatus

    status = AgentStatus("n", "f", "pc", "1", "idle", (), {}, None, None, FetchProgress(), WorkerStatus(), None,
                         tags=("finance", "floor-2"))
    body = json.loads(json.dumps(status.to_dict()))
    assert body["tags"] == ["finance", "floor-2"] and AgentStatus.from_dict(body).tags == ("finance", "floor-2")
    old = {k: v for k, v in body.items() if k != "tags"}
    assert AgentStatus.from_dict(old).tags == ()
    assert AgentStatus.from_dict({**body, "tags": ["ok", "not ok", 3]}).tags == ("ok",)
