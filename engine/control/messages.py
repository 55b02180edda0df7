"""Control-plane messages between the console and an agent (HTTPS + JSON, mutual TLS).

The console tells an agent what to serve with an :class:`Assignment`: the export's manifest
(which names every file with its sha256), the stage to serve, where to fetch the files from,
where to listen and which neighbour to dial. The agent answers with :class:`AgentStatus`.

Everything arriving from the network is parsed here, once, into frozen objects; a malformed
request raises :class:`ControlRequestError` with a message fit for a 400 answer, and nothing
downstream ever sees a raw dict. The routes themselves are listed in docs/CONTROL_API.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.control.tags import reported_tags
from engine.errors import STATEFUL_RETIRED, DeskfleetError, ManifestError
from engine.shards.manifest import Manifest, parse_manifest, safe_join, serving_runtime

API_VERSION = 1
MAX_BODY_BYTES = 4 << 20  # a manifest of a 128-layer export is ~100 kB; anything near this is hostile
AGENT_STATES = ("not-joined", "idle", "fetching", "serving", "paused", "error")
WORKER_STATES = ("stopped", "starting", "running", "backoff", "failed")
_HOSTPORT = re.compile(r"^[A-Za-z0-9.\-:\[\]]{1,255}:\d{1,5}$")
_EXPORT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")
# How a ring's workers serve their stage: "paged" (a CPU/GPU export: continuous batching on
# PagedAttention, block pools sized by the console) or "static" (an NPU-target export: packed slots).
# "stateful" (a KV state per stream) was retired; an assignment naming it is refused with the reason.
RUNTIMES = ("paged", "static")


class ControlRequestError(DeskfleetError):
    """A control-API request is malformed or not allowed in the agent's current state (-> HTTP 4xx).

    ``status`` is the HTTP status to answer with (400 malformed, 403 forbidden, 409 wrong state,
    507 no disk space).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _field(data: dict[str, Any], name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    if name not in data or data[name] is None:
        if optional:
            return None
        raise ControlRequestError(f"field {name!r} is missing")
    value = data[name]
    if isinstance(value, bool) and kind is int:
        raise ControlRequestError(f"field {name!r} must be an integer, not {value!r}")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ControlRequestError(f"field {name!r} must be {names}, got {type(value).__name__}")
    return value


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port) with a 400-style error naming ``what``."""
    if not isinstance(text, str) or not _HOSTPORT.match(text):
        raise ControlRequestError(f"{what} must be HOST:PORT, got {text!r}")
    host, _, port = text.rpartition(":")
    if not 0 < int(port) < 65536:
        raise ControlRequestError(f"{what} has port {port} outside 1..65535")
    return host.strip("[]"), int(port)


def decode_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or ControlRequestError."""
    if len(raw) > MAX_BODY_BYTES:
        raise ControlRequestError(f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", 413)
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as exc:  # also 4300+ digit numbers and nesting too deep to parse
        raise ControlRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ControlRequestError("request body must be a JSON object")
    return data


@dataclass(frozen=True)
class WorkerSettings:
    """How the agent runs its stage worker."""

    device: str = "CPU"
    threads: int | None = None
    exact: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerSettings:
        device = _field(data, "device", str, optional=True) or "CPU"
        if not re.fullmatch(r"(CPU|GPU(\.\d+)?|NPU)", device):
            raise ControlRequestError(f"device {device!r} is not CPU, GPU, GPU.<n> or NPU")
        threads = _field(data, "threads", int, optional=True)
        if threads is not None and not 1 <= threads <= 1024:
            raise ControlRequestError(f"threads must be 1..1024, got {threads}")
        return cls(device, threads, bool(_field(data, "exact", bool, optional=True)))


@dataclass(frozen=True)
class Assignment:
    """One stage of one export for one agent, and its place in the ring.

    ``manifest_json`` is the export's manifest verbatim; ``manifest_sha256`` lets the agent check
    it was not altered in transit or in its store. ``source`` is the base URL the files are
    fetched from (the console's shard server): file ``p`` of the manifest is ``source + p``.
    ``next_hop`` is the next stage's data address, or the coordinator's return port for the last
    stage. ``api_url`` is the fleet's OpenAI-compatible API, for the tray's chat window.

    Who the worker deals with on the data plane (node ids, sha256 of the peers' certificates;
    see engine.trust.peer_policy): ``expect_upstream`` may dial its listener (the previous stage's
    agent, or the console for stage 0; two during a failover move), ``expect_next`` must answer
    at ``next_hop`` (the next stage's agent, or the console's return port for the last stage).
    ``deny`` is the console's revocation list, refused by the worker and the control API alike.

    ``runtime`` is how the worker serves (:data:`RUNTIMES`): ``paged`` starts it with ``--paged``
    and a KV block pool of the agent's ``kv_pool_mb``; absent means the one the export's target
    calls for (:func:`engine.shards.manifest.serving_runtime`).
    """

    export_id: str
    stage: int
    manifest_json: str
    manifest_sha256: str
    source: str
    listen_port: int
    next_hop: str
    worker: WorkerSettings = WorkerSettings()
    api_url: str | None = None
    events_url: str | None = None
    expect_upstream: tuple[str, ...] = ()
    expect_next: str | None = None
    deny: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)  # the fleet API's key, for the tray's chat
    runtime: str = "paged"

    @property
    def manifest(self) -> Manifest:
        return parse_manifest(json.loads(self.manifest_json))

    def files(self):
        """The manifest entries this stage needs (its directory only; the coordinator tokenizes)."""
        return self.manifest.stages[self.stage].files

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def create(cls, manifest_json: str, **kwargs: Any) -> Assignment:
        digest = hashlib.sha256(manifest_json.encode()).hexdigest()
        return cls(manifest_json=manifest_json, manifest_sha256=digest, **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Assignment:
        """Validate a decoded assignment; every problem is a ControlRequestError (HTTP 400)."""
        export_id = _field(data, "export_id", str)
        if not _EXPORT_ID.match(export_id):
            raise ControlRequestError(f"export_id {export_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
        stage = _field(data, "stage", int)
        manifest_json = _field(data, "manifest_json", str)
        digest = _field(data, "manifest_sha256", str)
        try:
            manifest_bytes = manifest_json.encode()
        except UnicodeEncodeError:  # a lone surrogate: JSON can carry it, UTF-8 cannot
            raise ControlRequestError("manifest_json is not valid Unicode text: refusing the assignment") from None
        if hashlib.sha256(manifest_bytes).hexdigest() != digest.lower():
            raise ControlRequestError("manifest_sha256 does not match manifest_json: refusing the assignment")
        try:
            manifest = parse_manifest(json.loads(manifest_json))
        except (ValueError, RecursionError, ManifestError) as exc:
            raise ControlRequestError(f"the assignment's manifest is invalid: {exc}") from exc
        if not 0 <= stage < len(manifest.stages):
            raise ControlRequestError(f"stage {stage} does not exist; the export has {len(manifest.stages)} stages")
        for entry in manifest.stages[stage].files:
            _check_relative(entry.path)
            if not re.fullmatch(r"[0-9a-f]{64}", entry.sha256) or entry.size < 0:
                raise ControlRequestError(f"manifest entry {entry.path!r} has no valid sha256/size")
        source = _field(data, "source", str)
        if not source.startswith("https://") or not source.endswith("/"):
            raise ControlRequestError(f"source must be an https:// URL ending in '/', got {source!r}")
        listen_port = _field(data, "listen_port", int)
        if not 0 <= listen_port < 65536:
            raise ControlRequestError(f"listen_port must be 0..65535, got {listen_port}")
        next_hop = _field(data, "next_hop", str)
        parse_hostport(next_hop, "next_hop")
        worker = WorkerSettings.from_dict(_field(data, "worker", dict, optional=True) or {})
        urls = {}
        for name in ("api_url", "events_url"):
            url = _field(data, name, str, optional=True)
            if url is not None and not re.match(r"^https?://", url):
                raise ControlRequestError(f"{name} must be an http(s) URL, got {url!r}")
            urls[name] = url
        peers = parse_peers(data)
        api_key = parse_api_key(data.get("api_key"))
        runtime = _field(data, "runtime", str, optional=True) or serving_runtime(manifest)
        if runtime == "stateful":
            raise ControlRequestError(STATEFUL_RETIRED)
        if runtime not in RUNTIMES:
            raise ControlRequestError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r:.40}")
        if runtime != serving_runtime(manifest):
            raise ControlRequestError(f"a {manifest.target}-target export is served by the {serving_runtime(manifest)} "
                                      f"runtime, not {runtime} (paged serves CPU/GPU exports, static NPU-target ones)")
        if runtime == "paged" and worker.device.startswith("NPU"):
            raise ControlRequestError(f"a {manifest.target}-target export cannot serve on {worker.device} "
                                      "(PagedAttention runs on CPU and GPU): an NPU serves an NPU-target export")
        return cls(export_id, stage, manifest_json, digest.lower(), source, listen_port, next_hop, worker, **urls,
                   **peers, api_key=api_key, runtime=runtime)

    def same_stage(self, other: Assignment) -> bool:
        """Whether ``other`` differs from this at most in the peers and the URLs shown to the tray:
        a running worker then takes it as a policy update instead of a restart."""
        return self._stage_only() == other._stage_only()

    def _stage_only(self) -> Assignment:
        return replace(self, expect_upstream=(), expect_next=None, deny=(), api_url=None, events_url=None,
                       api_key=None)

    def peer_policy_json(self) -> dict[str, Any]:
        """The worker's peer policy (the ``--tls-stdin`` keys of engine.trust.peer_policy)."""
        return {"expect_upstream": list(self.expect_upstream), "expect_next": self.expect_next,
                "deny": list(self.deny)}


MAX_NODE_IDS = 1024  # a deny list of a whole office still fits; engine.trust.peer_policy has the same cap


def parse_node_id(value: Any, what: str) -> str:
    """A node id (64 hex digits, lowercased), or ControlRequestError naming ``what``."""
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", value):
        raise ControlRequestError(f"{what} must be a node id (64 hex digits), got {value!r:.80}")
    return value.lower()


def parse_api_key(value: Any) -> str | None:
    """The fleet API's key as an assignment or ``POST /v1/deny`` carries it (absent: None)."""
    if value is None:
        return None
    if not (isinstance(value, str) and 0 < len(value) <= 256 and value.isascii() and value.isprintable()):
        raise ControlRequestError("api_key must be 1-256 printable ASCII characters")
    return value


def parse_node_ids(value: Any, what: str) -> tuple[str, ...]:
    """A list of node ids -> a sorted, de-duplicated tuple (absent: empty)."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > MAX_NODE_IDS:
        raise ControlRequestError(f"{what} must be a list of at most {MAX_NODE_IDS} node ids")
    return tuple(sorted({parse_node_id(v, what) for v in value}))


def parse_peers(data: dict[str, Any]) -> dict[str, Any]:
    """An assignment's ``expect_upstream``, ``expect_next`` and ``deny``, validated."""
    upstream = parse_node_ids(data.get("expect_upstream"), "expect_upstream")
    nxt = data.get("expect_next")
    return {"expect_upstream": upstream, "expect_next": None if nxt is None else parse_node_id(nxt, "expect_next"),
            "deny": parse_node_ids(data.get("deny"), "deny")}


def _check_relative(rel: str) -> None:
    """Refuse a manifest path that could escape the shard store (checked against a dummy root)."""
    try:
        safe_join(Path("/nonexistent-root"), rel)
    except ManifestError as exc:
        raise ControlRequestError(str(exc)) from exc


@dataclass(frozen=True)
class FetchProgress:
    """How far the shard download is: bytes done of total, the file in hand, and any failure."""

    done_bytes: int = 0
    total_bytes: int = 0
    current: str | None = None
    finished: bool = False
    error: str | None = None

    @property
    def fraction(self) -> float:
        return 1.0 if self.total_bytes == 0 else self.done_bytes / self.total_bytes


@dataclass(frozen=True)
class WorkerStatus:
    state: str = "stopped"
    pid: int | None = None
    restarts: int = 0
    rss_bytes: int | None = None
    steps_per_s: float = 0.0
    streams: int = 0
    last_error: str | None = None
    policy_updates: int = 0  # peer-policy updates the running worker applied without a restart


@dataclass(frozen=True)
class AgentStatus:
    """What ``GET /v1/status`` answers (also the source of the tray's status line).

    ``kv_pool_mb``: the MiB this PC gives its stage's KV block pool when it serves paged (the
    agent's setting, capped by its RAM); the console sizes a paged ring's pool by the smallest.
    None from an agent too old to serve paged.

    ``cpu_percent``: the whole PC's CPU use (0-100, all cores together) since the previous read of
    at least a second ago; ``memory_used_bytes``: its RAM in use (total minus available). Both
    None when unknown: the first read of a just-started agent, or an agent from before them.
    """

    node_id: str
    fleet_id: str
    name: str
    version: str
    state: str
    paused_reasons: tuple[str, ...]
    inventory: dict[str, Any]
    export_id: str | None
    stage: int | None
    fetch: FetchProgress
    worker: WorkerStatus
    api_url: str | None
    kv_pool_mb: int | None = None
    tags: tuple[str, ...] = ()  # the agent's own tags (its settings); engine.control.tags
    cpu_percent: float | None = None
    memory_used_bytes: int | None = None
    hop_bytes_sent: int | None = None  # the stage workers' frames to their next hop since the agent started

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentStatus:
        return cls(
            node_id=data["node_id"], fleet_id=data["fleet_id"], name=data["name"], version=data["version"],
            state=data["state"], paused_reasons=tuple(data["paused_reasons"]), inventory=data["inventory"],
            export_id=data.get("export_id"), stage=data.get("stage"), fetch=FetchProgress(**data["fetch"]),
            worker=WorkerStatus(**data["worker"]), api_url=data.get("api_url"),
            kv_pool_mb=_pool_mb(data.get("kv_pool_mb")), tags=reported_tags(data.get("tags")),
            cpu_percent=_percent(data.get("cpu_percent")), memory_used_bytes=_bytes(data.get("memory_used_bytes")),
            hop_bytes_sent=_bytes(data.get("hop_bytes_sent")),
        )


def _percent(value: Any) -> float | None:
    """A reported CPU percentage (absent, not a number or outside 0-100: None)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 100.0
    return float(value) if ok else None


def _bytes(value: Any) -> int | None:
    """A reported byte count (absent or not a non-negative integer: None)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _pool_mb(value: Any) -> int | None:
    """An agent's reported ``kv_pool_mb`` (absent or not a positive integer: None, as from an old agent)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
