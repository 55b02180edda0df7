"""The agent's settings as one run resolves them (``resolve_settings``: the headless agent and the
tray both call it): the saved file, with the command line's choices laid over it and kept."""

from __future__ import annotations

import json

import pytest

from agent.service.settings import SETTINGS_FILE, SettingsError, load_settings, resolve_settings
from engine.errors import DeskfleetError


def test_a_fresh_state_dir_gets_defaults_written_and_no_choices_change_nothing(tmp_path):
    state_dir, settings = resolve_settings(tmp_path)
    assert state_dir == tmp_path
    assert load_settings(tmp_path) == settings  # written, so the instance id sticks
    again_dir, again = resolve_settings(tmp_path)
    assert (again_dir, again) == (tmp_path, settings)


def test_choices_given_are_laid_over_the_saved_settings_and_saved(tmp_path):
    _, first = resolve_settings(tmp_path, control_port=0, seeds=["10.0.0.5:7212"])
    assert (first.control_port, first.seeds) == (0, ("10.0.0.5:7212",))
    _, later = resolve_settings(tmp_path, interface="127.0.0.1")  # a later run without those flags ...
    assert (later.control_port, later.seeds, later.interface) == (0, ("10.0.0.5:7212",), "127.0.0.1")  # ... keeps them
    assert later.instance == first.instance
    assert json.loads((tmp_path / SETTINGS_FILE).read_text())["interface"] == "127.0.0.1"
    _, pooled = resolve_settings(tmp_path, kv_pool_mb=256)  # --kv-pool-mb, kept for the next run
    assert resolve_settings(tmp_path)[1].kv_pool_mb == pooled.kv_pool_mb == 256


def test_a_bad_seed_or_port_is_refused_before_anything_is_written(tmp_path):
    _, before = resolve_settings(tmp_path)
    saved = (tmp_path / SETTINGS_FILE).read_bytes()
    with pytest.raises(DeskfleetError, match="--seed"):
        resolve_settings(tmp_path, data_port=7300, seeds=["not-an-address"])
    with pytest.raises(SettingsError, match="control_port must be 0..65535"):
        resolve_settings(tmp_path, control_port=70000)
    with pytest.raises(SettingsError, match="kv_pool_mb must be a whole number of MiB"):
        resolve_settings(tmp_path, kv_pool_mb=4)
    assert (tmp_path / SETTINGS_FILE).read_bytes() == saved


def test_no_state_dir_means_the_per_user_default(tmp_path, monkeypatch):
    monkeypatch.setenv("DESKFLEET_AGENT_HOME", str(tmp_path / "home"))
    state_dir, _ = resolve_settings(None)
    assert state_dir == tmp_path / "home" and (state_dir / SETTINGS_FILE).is_file()
