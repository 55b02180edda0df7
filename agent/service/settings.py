"""The agent's settings (chosen by the person at the PC or the installer) and its runtime state
(what the fleet service assigned, whether the person paused it), each one JSON file in the state dir.

Both are parsed once into frozen objects. Files are replaced atomically (write a temporary file,
fsync, rename), so a crash never leaves half a file; a file that does not parse is never
overwritten: loading it raises :class:`SettingsError` naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.atomic_file import write_json_atomic
from engine.control.messages import parse_hostport
from engine.control.tags import parse_tags
from engine.errors import DeskfleetError, TagError
from engine.machine.this_pc import DEFAULT_CONTROL_PORT, DEFAULT_DATA_PORT, default_agent_dir

SETTINGS_FILE = "settings.json"
STATE_FILE = "state.json"
_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_HHMM = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")
DEFAULT_KV_POOL_MB = 1024
KV_POOL_RAM_SHARE = 0.25  # a stage's KV block pool never takes more of the PC's RAM than this
_KV_POOL_MB_RANGE = (16, 1 << 20)


class SettingsError(DeskfleetError):
    """The agent's settings or state file is unreadable or holds an invalid value (the file is kept)."""


def default_state_dir() -> Path:
    """``$DESKFLEET_AGENT_HOME``, else the platform's per-user data directory."""
    return default_agent_dir()


@dataclass(frozen=True)
class OfficeHours:
    """A weekly window in which the agent does not serve (the PC belongs to its user then)."""

    days: tuple[str, ...] = ("mon", "tue", "wed", "thu", "fri")
    start: str = "09:00"
    end: str = "17:00"

    def __post_init__(self) -> None:
        bad = [d for d in self.days if d not in _DAYS]
        if bad or not self.days:
            raise SettingsError(f"office hours days must be some of {', '.join(_DAYS)}; got {list(self.days)}")
        for value in (self.start, self.end):
            if not _HHMM.match(value):
                raise SettingsError(f"office hours times must be HH:MM (24 h), got {value!r}")
        if self.start >= self.end:
            raise SettingsError(f"office hours start {self.start} must be before end {self.end}")


@dataclass(frozen=True)
class AgentSettings:
    """Defaults are what a person installing the agent would want: pause while they use the PC
    and on battery, serve any time otherwise."""

    name: str = field(default_factory=socket.gethostname)
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # keeps mDNS names unique
    interface: str | None = None  # None: every interface; tests pass 127.0.0.1 or a namespace address
    control_port: int = DEFAULT_CONTROL_PORT
    data_port: int = DEFAULT_DATA_PORT
    seeds: tuple[str, ...] = ()  # console HOST:PORTs for networks that drop multicast
    pause_while_in_use: bool = True
    resume_after_idle_s: float = 300.0
    pause_on_battery: bool = True
    office_hours: OfficeHours | None = None
    bandwidth_cap_bytes_s: int | None = None
    start_at_login: bool = False
    # MiB this PC gives its stage's KV block pool when the ring serves paged: the one memory that
    # grows with the number of users. More lets more people chat at once (and keeps longer chats
    # cached); it is capped at KV_POOL_RAM_SHARE of the PC's RAM (kv_pool_budget_mb), and the
    # console sizes the ring's pool by the smallest budget among its PCs.
    kv_pool_mb: int = DEFAULT_KV_POOL_MB
    # A warm spare (agent.service.spare_policy): a second worker process holding the stage's shard
    # compiled, so a crashed worker is replaced in milliseconds. It doubles the stage's weights in
    # memory: "auto" keeps one when the PC's free memory allows, "on" always, "off" never.
    warm_spare: str = "auto"
    # Labels the admin groups PCs by ("floor-2", "finance"); placement can keep to or avoid them.
    # The agent reports them in its status; an admin may set others from the service, which win.
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "tags", parse_tags(self.tags))
        except TagError as exc:
            raise SettingsError(str(exc)) from exc
        if self.warm_spare not in ("auto", "on", "off"):
            raise SettingsError(f"warm_spare must be auto, on or off, got {self.warm_spare!r}")
        for port_name in ("control_port", "data_port"):
            port = getattr(self, port_name)
            if not isinstance(port, int) or not 0 <= port < 65536:
                raise SettingsError(f"{port_name} must be 0..65535 (0 picks a free port), got {port!r}")
        if not isinstance(self.resume_after_idle_s, int | float) or self.resume_after_idle_s < 0:
            raise SettingsError(f"resume_after_idle_s must be >= 0 seconds, got {self.resume_after_idle_s!r}")
        if self.bandwidth_cap_bytes_s is not None and self.bandwidth_cap_bytes_s <= 0:
            raise SettingsError("bandwidth_cap_bytes_s must be positive (or null for no cap)")
        if not self.name or len(self.name) > 63:
            raise SettingsError("name must be 1..63 characters")
        low, high = _KV_POOL_MB_RANGE
        if not isinstance(self.kv_pool_mb, int) or isinstance(self.kv_pool_mb, bool) or \
                not low <= self.kv_pool_mb <= high:
            raise SettingsError(f"kv_pool_mb must be a whole number of MiB in {low}..{high} (the memory this PC gives "
                                f"its stage's KV block pool; default {DEFAULT_KV_POOL_MB}), got {self.kv_pool_mb!r}")

    def kv_pool_budget_mb(self, ram_bytes: int | None) -> int:
        """The KV pool MiB this PC may use: ``kv_pool_mb``, capped at KV_POOL_RAM_SHARE of
        ``ram_bytes`` (unknown RAM: uncapped), never below the smallest setting."""
        if not ram_bytes:
            return self.kv_pool_mb
        return max(_KV_POOL_MB_RANGE[0], min(self.kv_pool_mb, int(ram_bytes * KV_POOL_RAM_SHARE) >> 20))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SettingsError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values = dict(data)
        try:
            if values.get("office_hours") is not None:
                hours = values["office_hours"]
                values["office_hours"] = OfficeHours(tuple(hours.get("days", OfficeHours.days)),
                                                     hours.get("start", OfficeHours.start),
                                                     hours.get("end", OfficeHours.end))
            if "seeds" in values:
                values["seeds"] = tuple(values["seeds"])
            if isinstance(values.get("tags"), list):
                values["tags"] = tuple(values["tags"])
            return cls(**values)
        except (TypeError, AttributeError) as exc:
            raise SettingsError(f"invalid settings: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys of the state file renamed since agents first wrote them: read under their new names.
STATE_OLD_KEYS = {"console_node_id": "service_node_id"}


@dataclass(frozen=True)
class AgentState:
    """What survives a restart: the assignment in force, whether to serve it, and the pauses."""

    assignment: dict[str, Any] | None = None
    serving: bool = False  # the fleet service asked for the worker to run (resumed after a pause or restart)
    manually_paused: bool = False
    remotely_paused: bool = False
    api_url: str | None = None
    # The node id of the fleet service this agent joined through (its certificate's sha256, seen
    # over the join's TLS): the only certificate the control API takes orders from. Replaced only
    # by a fresh join; None for an agent that joined before the service was pinned. State files
    # written before the rename hold it as "console_node_id" (STATE_OLD_KEYS): still read.
    service_node_id: str | None = None
    # Node ids the fleet service revoked (sent with every assignment and by POST /v1/deny): refused by
    # the control API and by the stage worker.
    deny: tuple[str, ...] = ()
    # This PC's own key for the fleet API (its tray's chat), issued by the fleet service at the join and
    # revoked when the PC is removed; None for an agent that joined an older console (the chat then
    # uses the key its assignment carries). The state file is 0600 (write_json_atomic).
    chat_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentState:
        for old_key, key in STATE_OLD_KEYS.items():
            if old_key in data:
                data = {key: data[old_key], **{k: v for k, v in data.items() if k != old_key}}
        try:
            if isinstance(data.get("deny"), list):
                data = {**data, "deny": tuple(data["deny"])}
            return cls(**data)
        except TypeError as exc:
            raise SettingsError(f"invalid agent state: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SettingsError(f"cannot read {path}: {exc}. Fix or delete the file (it has been left as it is)") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"{path} must hold a JSON object. Fix or delete the file (it has been left as it is)")
    return data


def load_settings(state_dir: Path) -> AgentSettings:
    """The settings in ``state_dir``; a fresh directory gets defaults written so the instance id sticks."""
    path = state_dir / SETTINGS_FILE
    data = _read_json(path)
    if data is None:
        settings = AgentSettings()
        write_json_atomic(path, settings.to_dict())
        return settings
    try:
        return AgentSettings.from_dict(data)
    except SettingsError as exc:
        raise SettingsError(f"{path}: {exc}. Fix or delete the file (it has been left as it is)") from exc


def save_settings(state_dir: Path, settings: AgentSettings) -> None:
    write_json_atomic(state_dir / SETTINGS_FILE, settings.to_dict())


def resolve_settings(state_dir: Path | None, *, interface: str | None = None, control_port: int | None = None,
                     data_port: int | None = None, seeds: Sequence[str] | None = None,
                     kv_pool_mb: int | None = None, tags: Sequence[str] | None = None) -> tuple[Path, AgentSettings]:
    """The state dir and settings one run of the agent uses (headless or tray): ``state_dir``
    (None: :func:`default_state_dir`) and its saved settings with the command line's choices laid
    over them. A choice given (not None; ``seeds`` non-empty) is saved, so the next run keeps it;
    a seed that is not HOST:PORT raises before anything is written; ``tags`` () clears them."""
    state_dir = state_dir or default_state_dir()
    settings = load_settings(state_dir)
    overrides: dict[str, Any] = {k: v for k, v in (("interface", interface), ("control_port", control_port),
                                                   ("data_port", data_port), ("kv_pool_mb", kv_pool_mb))
                                 if v is not None}
    if tags is not None:
        overrides["tags"] = tuple(tags)
    if seeds:
        for seed in seeds:
            parse_hostport(seed, "--seed")
        overrides["seeds"] = tuple(seeds)
    if overrides:
        settings = dataclasses.replace(settings, **overrides)  # validated before it is saved
        save_settings(state_dir, settings)
    return state_dir, settings


def load_state(state_dir: Path) -> AgentState:
    data = _read_json(state_dir / STATE_FILE)
    return AgentState() if data is None else AgentState.from_dict(data)


def save_state(state_dir: Path, state: AgentState) -> None:
    write_json_atomic(state_dir / STATE_FILE, state.to_dict())
