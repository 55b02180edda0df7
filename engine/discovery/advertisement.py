"""The advertisement an agent publishes over mDNS, and the rules a peer's record must pass.

Pure (no sockets): `engine.discovery.mdns` moves these values over zeroconf. A record arrives from
any host on the LAN, so every field is bounded and checked, and every failure is one named
`DiscoveryError` saying which field is wrong. The same checks run when an agent builds its own
advertisement, so an invalid one is never published.

Wire form: the SRV port is the agent's control port, the A records its addresses, and the TXT
record carries the rest under short keys (``TXT_KEYS``), each value at most 250 bytes and the
whole record under 1300, so an announcement stays one unfragmented packet.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from zeroconf import IPVersion, ServiceInfo

from engine.errors import DiscoveryError

SERVICE_TYPE = "_deskfleet._tcp.local."
TXT_VERSION = "1"          # bumped only for an incompatible change of the TXT keys below
MAX_TXT_BYTES = 1300       # whole TXT record: keeps the announcement in one unfragmented packet
MAX_VALUE_BYTES = 250      # one value: a TXT string (key=value) is at most 255 bytes on the wire
MAX_INSTANCE_BYTES = 63    # one DNS label
MAX_DEVICES = 16
MAX_ADDRESSES = 8
_SUFFIX = "." + SERVICE_TYPE

_ID = re.compile(r"[A-Za-z0-9:._-]{0,128}")         # node and fleet ids: "" before the join
_VERSION = re.compile(r"[A-Za-z0-9.+_-]{1,32}")
_DEVICE = re.compile(r"[A-Za-z0-9._-]{1,32}")       # OpenVINO names: CPU, GPU.0, NPU
_DECIMAL = re.compile(r"[0-9]{1,19}")               # no sign, no "_", no Unicode digits
_INSTANCE_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f.]")


class AgentState(StrEnum):
    """What an agent is doing, as the console shows it."""

    NOT_JOINED = "not-joined"
    IDLE = "idle"
    FETCHING = "fetching"
    SERVING = "serving"
    PAUSED = "paused"
    ERROR = "error"


# TXT key -> Advertisement field. Short keys keep the record small; "txtvers" is the DNS-SD
# convention (RFC 6763 §6.7) for telling an old browser that the record changed shape.
TXT_KEYS: Mapping[str, str] = {
    "txtvers": "",
    "id": "node_id",
    "fl": "fleet_id",
    "ver": "version",
    "dev": "devices",
    "mem": "memory_bytes",
    "st": "state",
}


def _fail(what: str, detail: str) -> DiscoveryError:
    return DiscoveryError(f"malformed Deskfleet advertisement: {what} {detail}; "
                          "the peer is ignored until it advertises a valid record (is it running "
                          "another Deskfleet version?)")


def _check_text(name: str, value: object, pattern: re.Pattern[str]) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise _fail(name, f"{value!r} is not of the form {pattern.pattern}")
    return value


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(name, f"{value!r} is not an integer in [{lo}, {hi}]")
    return value


def _check_instance(instance: object) -> str:
    if not isinstance(instance, str) or not instance:
        raise _fail("instance name", f"{instance!r} is empty or not text")
    if len(instance.encode("utf-8", "surrogatepass")) > MAX_INSTANCE_BYTES:
        raise _fail("instance name", f"{instance[:80]!r} is longer than {MAX_INSTANCE_BYTES} bytes")
    if _INSTANCE_FORBIDDEN.search(instance) or not instance.isprintable():
        raise _fail("instance name", f"{instance!r} holds a dot or a control character")
    return instance


def _check_ipv4(name: str, value: object) -> str:
    try:
        address = ipaddress.IPv4Address(value)
    except (ipaddress.AddressValueError, ValueError, TypeError):
        raise _fail(name, f"{value!r} is not an IPv4 address") from None
    if address.is_unspecified or address.is_multicast:
        raise _fail(name, f"{value} cannot be an agent's address")
    return str(address)


def instance_name(label: str, unique: str) -> str:
    """A valid instance name ``<label>-<unique>`` from any PC name: dots and control characters
    become ``-`` (a dot would split the DNS label) and the label is cut, on a character
    boundary, so the whole name fits one 63-byte DNS label. ``unique`` keeps names distinct
    when several agents run on one host; it must itself be short and valid."""
    clean = "".join(c if c.isprintable() and c != "." else "-" for c in label).strip("- ")
    budget = MAX_INSTANCE_BYTES - 1 - len(unique.encode())
    clean = clean.encode()[:max(budget, 0)].decode("utf-8", "ignore").rstrip("- ")
    return _check_instance(f"{clean or 'agent'}-{unique}")


def new_instance_name(host: str | None = None) -> str:
    """A fresh instance name, ``<host>-<8 hex>``: readable in the console, unique per agent."""
    return instance_name(host or socket.gethostname(), secrets.token_hex(4))


@dataclass(frozen=True)
class Advertisement:
    """What one agent tells the network about itself. Validated on construction, so an invalid
    one is never published, and a peer's is rejected by the same rules."""

    instance: str
    node_id: str
    fleet_id: str
    version: str
    devices: tuple[str, ...]
    memory_bytes: int
    state: AgentState
    control_port: int
    addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_instance(self.instance)
        _check_text("node id", self.node_id, _ID)
        _check_text("fleet id", self.fleet_id, _ID)
        _check_text("version", self.version, _VERSION)
        if not isinstance(self.devices, tuple) or len(self.devices) > MAX_DEVICES:
            raise _fail("device list", f"{self.devices!r} is not a tuple of at most {MAX_DEVICES}")
        for device in self.devices:
            _check_text("device name", device, _DEVICE)
        if len(set(self.devices)) != len(self.devices):
            raise _fail("device list", f"{self.devices!r} names a device twice")
        _check_int("memory", self.memory_bytes, 0, 2**63 - 1)
        try:
            object.__setattr__(self, "state", AgentState(self.state))
        except ValueError:
            raise _fail("state", f"{self.state!r} is not one of {[s.value for s in AgentState]}") from None
        # an agent that has not joined has no control API yet (it opens with the fleet certificate)
        lowest_port = 0 if self.state is AgentState.NOT_JOINED else 1
        _check_int("control port", self.control_port, lowest_port, 65535)
        if not isinstance(self.addresses, tuple) or len(self.addresses) > MAX_ADDRESSES:
            raise _fail("addresses", f"{self.addresses!r} is not a tuple of at most {MAX_ADDRESSES}")
        object.__setattr__(self, "addresses", tuple(_check_ipv4("address", a) for a in self.addresses))
        for key, value in self.to_properties().items():
            if len(value.encode()) > MAX_VALUE_BYTES:
                raise _fail(f"TXT value {key!r}", f"is longer than {MAX_VALUE_BYTES} bytes")

    @property
    def service_name(self) -> str:
        """The full DNS-SD name, ``<instance>._deskfleet._tcp.local.``."""
        return self.instance + _SUFFIX

    def to_properties(self) -> dict[str, str]:
        """The TXT record as key -> value; the inverse of what `from_service_info` reads."""
        return {"txtvers": TXT_VERSION, "id": self.node_id, "fl": self.fleet_id,
                "ver": self.version, "dev": ",".join(self.devices),
                "mem": str(self.memory_bytes), "st": self.state.value}

    @classmethod
    def from_service_info(cls, info: ServiceInfo) -> Advertisement:
        """Read and check a resolved peer's record. Raises `DiscoveryError`, and nothing else,
        for any malformed, oversized or missing field."""
        name = info.name if isinstance(info.name, str) else ""
        if not name.lower().endswith(_SUFFIX.lower()):
            raise _fail("service name", f"{name[:100]!r} is not of type {SERVICE_TYPE}")
        instance = name[: -len(_SUFFIX)]
        text = info.text if isinstance(info.text, bytes) else b""
        if len(text) > MAX_TXT_BYTES:
            raise _fail("TXT record", f"of {len(text)} bytes exceeds {MAX_TXT_BYTES}")
        values = _decode_txt(info.properties)
        if values["txtvers"] != TXT_VERSION:
            raise _fail("TXT version", f"{values['txtvers']!r} is not {TXT_VERSION!r}")
        _check_text("memory", values["mem"], _DECIMAL)
        if info.port is None:
            raise _fail("control port", "is missing (no SRV record)")
        return cls(instance=instance, node_id=values["id"], fleet_id=values["fl"],
                   version=values["ver"],
                   devices=tuple(values["dev"].split(",")) if values["dev"] else (),
                   memory_bytes=int(values["mem"]), state=values["st"],  # type: ignore[arg-type]
                   control_port=info.port,
                   addresses=tuple(info.parsed_addresses(IPVersion.V4Only)))


def _decode_txt(properties: Mapping[bytes, bytes | None]) -> dict[str, str]:
    """Every known key, as ASCII text; unknown keys are ignored (a newer agent may add some)."""
    values: dict[str, str] = {}
    for key in TXT_KEYS:
        raw = properties.get(key.encode())
        if raw is None:
            raise _fail(f"TXT key {key!r}", "is missing or has no value")
        if len(raw) > MAX_VALUE_BYTES:
            raise _fail(f"TXT key {key!r}", f"has a value longer than {MAX_VALUE_BYTES} bytes")
        try:
            values[key] = raw.decode("ascii")
        except UnicodeDecodeError:
            raise _fail(f"TXT key {key!r}", "is not ASCII") from None
    return values
