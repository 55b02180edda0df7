"""Facts about this PC that the agent and ``deskfleet doctor`` both need: the address it reaches
its network from, and where the agent keeps its state by default. (The doctor lives in
``engine``, which may not import ``agent``; the agent takes these from here.)"""

from __future__ import annotations

import os
import socket
from pathlib import Path

AGENT_HOME_ENV = "DESKFLEET_AGENT_HOME"
DEFAULT_CONTROL_PORT = 7210
DEFAULT_DATA_PORT = 7211


def primary_ipv4() -> str:
    """The address this PC reaches its network from (the default route's interface); no packet is
    sent. mDNS and the ports bind to it when the settings name no interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def default_agent_dir() -> Path:
    """``$DESKFLEET_AGENT_HOME``, else the platform's per-user data directory."""
    if env := os.environ.get(AGENT_HOME_ENV):
        return Path(env)
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "Deskfleet" / "agent"
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "deskfleet" / "agent"
