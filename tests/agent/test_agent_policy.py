"""Pure agent policy: pause decisions, settings files, assignment parsing (no sockets, no Qt)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import replace

import pytest

from agent.service import pause
from agent.service.settings import (
    AgentSettings,
    AgentState,
    OfficeHours,
    SettingsError,
    load_settings,
    load_state,
    save_settings,
    save_state,
)
from agent.service.supervisor import worker_args
from engine.control.messages import (
    AgentStatus,
    Assignment,
    ControlRequestError,
    FetchProgress,
    WorkerStatus,
    decode_body,
    parse_hostport,
)

MONDAY_NOON = dt.datetime(2026, 11, 30, 12, 0)
SUNDAY_NOON = dt.datetime(2026, 11, 29, 12, 0)


def obs(idle_s=1000.0, on_ac=True, now=MONDAY_NOON):
    return pause.Observation(idle_s, on_ac, now)


def test_input_pauses_at_once_and_idle_resumes_after_the_threshold():
    s = AgentSettings(name="pc", resume_after_idle_s=60)
    state = pause.decide(s, obs(idle_s=500), pause.PauseState())
    assert not state.paused
    state = pause.decide(s, obs(idle_s=0.2), state)
    assert state.paused and state.reasons == (pause.IN_USE,)
    # reading a page: no input for 30 s, still within the resume threshold
    state = pause.decide(s, obs(idle_s=30), state)
    assert state.paused
    state = pause.decide(s, obs(idle_s=61), state)
    assert not state.paused
    # an old input never pauses an agent that was not paused for use
    assert not pause.decide(s, obs(idle_s=30), state).paused


def test_in_use_is_ignored_when_the_toggle_is_off_or_idle_is_unknown():
    off = AgentSettings(name="pc", pause_while_in_use=False)
    assert not pause.decide(off, obs(idle_s=0.0), pause.PauseState()).paused
    on = AgentSettings(name="pc")
    assert not pause.decide(on, obs(idle_s=None), pause.PauseState()).paused


def test_battery_office_hours_manual_and_remote_each_pause_and_combine():
    hours = OfficeHours(("mon", "tue", "wed", "thu", "fri"), "09:00", "17:00")
    s = AgentSettings(name="pc", office_hours=hours)
    assert pause.decide(s, obs(on_ac=False, now=SUNDAY_NOON), pause.PauseState()).reasons == (pause.BATTERY,)
    assert pause.decide(s, obs(on_ac=None, now=SUNDAY_NOON), pause.PauseState()).reasons == ()  # desktop PC
    assert pause.decide(s, obs(), pause.PauseState()).reasons == (pause.OFFICE_HOURS,)
    assert not pause.decide(s, obs(now=MONDAY_NOON.replace(hour=17)), pause.PauseState()).paused
    both = pause.decide(s, obs(idle_s=0.0, on_ac=False), pause.PauseState(), manual=True, remote=True)
    assert both.reasons == (pause.MANUAL, pause.REMOTE, pause.IN_USE, pause.BATTERY, pause.OFFICE_HOURS)
    no_battery_rule = AgentSettings(name="pc", pause_on_battery=False)
    assert not pause.decide(no_battery_rule, obs(on_ac=False), pause.PauseState()).paused


def test_settings_round_trip_and_defaults_are_written_once(tmp_path):
    first = load_settings(tmp_path)
    assert (tmp_path / "settings.json").is_file()
    assert load_settings(tmp_path).instance == first.instance  # the mDNS instance id sticks
    changed = AgentSettings(name="desk-7", seeds=("10.0.0.2:7300",), office_hours=OfficeHours(),
                            bandwidth_cap_bytes_s=1_000_000)
    save_settings(tmp_path, changed)
    assert load_settings(tmp_path) == changed
    state = AgentState(serving=True, manually_paused=True, api_url="http://10.0.0.2:8000")
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read"),
    ("[1, 2]", "JSON object"),
    ('{"control_port": 70000}', "control_port"),
    ('{"nonsense": 1}', "unknown setting"),
    ('{"office_hours": {"start": "25:00"}}', "HH:MM"),
    ('{"office_hours": {"days": ["funday"]}}', "days"),
])
def test_a_bad_settings_file_is_explained_and_left_in_place(tmp_path, content, message):
    path = tmp_path / "settings.json"
    path.write_text(content)
    with pytest.raises(SettingsError, match=message):
        load_settings(tmp_path)
    assert path.read_text() == content  # nothing lost


def _manifest_json(tiny_export) -> str:
    return (tiny_export("llama", 2) / "manifest.json").read_text()


def _assignment_dict(manifest_json: str, **over):
    data = {"export_id": "tiny-2", "stage": 1, "manifest_json": manifest_json,
            "manifest_sha256": hashlib.sha256(manifest_json.encode()).hexdigest(),
            "source": "https://127.0.0.1:7300/v1/shards/tiny-2/", "listen_port": 0,
            "next_hop": "127.0.0.1:7100", "worker": {"device": "CPU", "threads": 1}}
    data.update(over)
    return data


def test_assignment_round_trips(tiny_export):
    mj = _manifest_json(tiny_export)
    a = Assignment.from_dict(_assignment_dict(mj))
    assert a.stage == 1 and a.worker.threads == 1
    assert Assignment.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    assert {e.path.split("/")[0] for e in a.files()} == {"stage_1"}


def test_runtime_defaults_to_what_serves_the_export_and_paged_reaches_the_worker_with_the_pool_budget(tiny_export):
    mj = _manifest_json(tiny_export)
    assert Assignment.from_dict(_assignment_dict(mj)).runtime == "paged"  # none sent: a CPU/GPU export serves paged
    paged = Assignment.from_dict(_assignment_dict(mj, runtime="paged"))
    assert paged.runtime == "paged" and Assignment.from_dict(paged.to_dict()) == paged
    assert not paged.same_stage(replace(paged, runtime="static"))  # a runtime change restarts the worker
    args = worker_args("/s", 1, "127.0.0.1:7211", "127.0.0.1:7100", device="CPU", threads=1, exact=False, tls=True,
                       paged=True, kv_pool_mb=384)
    assert args[args.index("--kv-pool-mb") + 1] == "384" and "--paged" in args
    static = worker_args("/s", 1, "127.0.0.1:7211", "127.0.0.1:7100", device="NPU", threads=1, exact=False,
                         tls=True)  # an NPU stage serves static: no block pool
    assert "--paged" not in static and "--kv-pool-mb" not in static
    with pytest.raises(ValueError, match="paged"):
        worker_args("/s", 1, "a:1", "b:2", device="CPU", threads=None, exact=False, tls=False, kv_pool_mb=64)


def test_kv_pool_budget_is_validated_saved_and_capped_by_the_ram(tmp_path):
    assert AgentSettings(name="pc").kv_pool_mb == 1024
    assert AgentSettings.from_dict({"name": "pc"}).kv_pool_mb == 1024  # a settings file from before the setting
    small = AgentSettings(name="pc", kv_pool_mb=256)
    save_settings(tmp_path, small)
    assert load_settings(tmp_path).kv_pool_mb == 256
    gib = 1 << 30
    assert AgentSettings(name="pc").kv_pool_budget_mb(16 * gib) == 1024
    assert AgentSettings(name="pc").kv_pool_budget_mb(2 * gib) == 512  # a quarter of the RAM at most
    assert AgentSettings(name="pc").kv_pool_budget_mb(None) == 1024  # RAM unknown: the setting
    assert small.kv_pool_budget_mb(32 << 20) == 16  # never below the smallest setting
    for bad in (0, 8, True, 1.5, "512", 1 << 21):
        with pytest.raises(SettingsError, match="kv_pool_mb"):
            AgentSettings(name="pc", kv_pool_mb=bad)


def test_an_agent_status_without_a_pool_budget_reads_as_an_old_agent():
    status = AgentStatus("n" * 64, "f", "pc", "0", "idle", (), {}, None, None, FetchProgress(), WorkerStatus(), None,
                         kv_pool_mb=512)
    assert AgentStatus.from_dict(json.loads(json.dumps(status.to_dict()))) == status
    old = {k: v for k, v in status.to_dict().items() if k != "kv_pool_mb"}
    assert AgentStatus.from_dict(old).kv_pool_mb is None
    assert AgentStatus.from_dict({**old, "kv_pool_mb": "512"}).kv_pool_mb is None


def _escaping_manifest(manifest_json: str) -> str:
    data = json.loads(manifest_json)
    # An extra entry: the graph and weights stay listed (parsing requires them), so only the
    # escape can refuse it.
    files = data["stages"][1]["files"]
    files.append({**files[0], "path": "../../../etc/evil"})
    return json.dumps(data)


@pytest.mark.parametrize("change, message", [
    ({"stage": 5}, "does not exist"),
    ({"stage": True}, "must be an integer"),
    ({"manifest_sha256": "0" * 64}, "does not match"),
    ({"source": "http://127.0.0.1/x/"}, "https"),
    ({"next_hop": "nowhere"}, "HOST:PORT"),
    ({"listen_port": 70000}, "listen_port"),
    ({"export_id": "../up"}, "export_id"),
    ({"worker": {"device": "TPU"}}, "device"),
    ({"worker": {"threads": 0}}, "threads"),
    ({"api_url": "ftp://x"}, "api_url"),
    ({"runtime": "batched"}, "runtime must be one of paged, static"),
    ({"runtime": "static"}, "served by the paged runtime, not static"),
    ({"runtime": "paged", "worker": {"device": "NPU"}}, "cannot serve on NPU"),
])
def test_bad_assignments_are_refused_with_a_reason(tiny_export, change, message):
    data = _assignment_dict(_manifest_json(tiny_export), **change)
    with pytest.raises(ControlRequestError, match=message):
        Assignment.from_dict(data)


def test_a_manifest_that_is_not_unicode_text_is_refused_not_a_server_error(tiny_export):
    data = {**_assignment_dict(_manifest_json(tiny_export)), "manifest_json": "\ud800"}  # JSON carries it; UTF-8 not
    with pytest.raises(ControlRequestError, match="not valid Unicode"):
        Assignment.from_dict(data)


def test_a_manifest_path_escaping_the_store_is_refused(tiny_export):
    mj = _escaping_manifest(_manifest_json(tiny_export))
    with pytest.raises(ControlRequestError, match="unsafe|escapes"):
        Assignment.from_dict(_assignment_dict(mj))


def test_missing_fields_and_bodies():
    with pytest.raises(ControlRequestError, match="missing"):
        Assignment.from_dict({})
    with pytest.raises(ControlRequestError, match="JSON"):
        decode_body(b"\xff\xfe")
    with pytest.raises(ControlRequestError, match="object"):
        decode_body(b"[]")
    with pytest.raises(ControlRequestError) as info:
        decode_body(b" " * (5 << 20))
    assert info.value.status == 413
    assert parse_hostport("[::1]:7000", "x") == ("::1", 7000)
    with pytest.raises(ControlRequestError):
        parse_hostport("h:0", "x")
