"""Links between the office's PCs, emulated in user space and with ``tbf`` (netem, the usual tool,
is not available here).

* :func:`shape` caps a PC's network cable: a token-bucket filter on both ends of its veth (what it
  sends, and what the bridge sends it). Transparent to everything on the PC: mDNS, the control
  API, the ring's activations.
* :class:`WanLink` puts a delay (and a bandwidth cap) on one hop that a client dials by address:
  ``deskfleet wan`` (engine.tools.wan_emulator) as a real process in the dialling PC's namespace,
  listening on that PC's own address and forwarding to the target. Used for the people's path to
  the fleet's API; a ring's own hops need the fleet service to dial a proxy (not yet possible
  from outside the service, see docs/BENCHMARKS.md "office").
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.fleet.netns import Host
from tests.support.processes import stop

WAN_START_TIMEOUT_S = 30.0


class LinkError(RuntimeError):
    """A link could not be set up (tc refused, the WAN emulator did not start)."""


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LinkError(f"tc {' '.join(args)} failed: {done.stderr.strip()}")


def shape(host: Host, mbit: float) -> None:
    """Cap ``host``'s cable at ``mbit`` Mbit/s each way (tbf on its veth's inner and outer end)."""
    rate = f"{mbit:g}mbit"
    burst = f"{max(16, int(mbit * 1000 / 8 / 100))}kb"  # ~10 ms of traffic, at least 16 kB
    _tc("-n", host.name, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst,
        "latency", "100ms")
    if host.veth:
        _tc("qdisc", "replace", "dev", host.veth, "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms")


@dataclass(frozen=True)
class WanHop:
    listen: str  # host:port to dial instead of the target
    target: str


@contextlib.contextmanager
def wan_link(source: Host, target: str, port: int, *, delay_ms: float, bandwidth_mbit: float | None = None,
             log: Path, cwd: Path | None = None) -> Iterator[WanHop]:
    """A ``deskfleet wan`` process in ``source``'s namespace on ``source.address:port`` forwarding to
    ``target`` (host:port) with ``delay_ms`` each way; stopped on exit."""
    argv = [sys.executable, "-m", "engine.cli.main", "wan", "--listen", f"{source.address}:{port}",
            "--target", target, "--delay-ms", f"{delay_ms:g}"]
    if bandwidth_mbit is not None:
        argv += ["--bandwidth-mbit", f"{bandwidth_mbit:g}"]
    with log.open("ab") as out:
        proc = subprocess.Popen(source.enter_argv(argv), stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                cwd=cwd, start_new_session=True)
    try:
        _wait_listening(source, port, proc, log)
        yield WanHop(f"{source.address}:{port}", target)
    finally:
        stop(proc, 10)


def _wait_listening(host: Host, port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + WAN_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise LinkError(f"the WAN emulator exited {proc.returncode}: {log.read_text()[-2000:]}")
        if f"{host.address}:{port}" in log.read_text(errors="replace"):
            return
        if time.monotonic() > deadline:
            raise LinkError(f"the WAN emulator did not listen on {host.address}:{port} in {WAN_START_TIMEOUT_S:g} s")
        time.sleep(0.1)

