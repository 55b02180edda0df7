"""Where the console finds its fleet service: the one configured (``--service URL`` with an admin
certificate), else the local one the state dir's ``fleet-service.json`` names, else one it starts.

A service the console starts runs detached — its own session (POSIX) or process group without
a console window (Windows), stdin closed, its output in ``<state_dir>/fleet-service.log`` — so
closing or killing the console never stops serving. No Qt here.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from console.fleet_api.admin_client import AdminApiError, AdminClient, ServiceUnreachableError

SERVICE_FILE = "fleet-service.json"
SOCKET_FILE = "admin.sock"
LOG_FILE = "fleet-service.log"
START_TIMEOUT_S = 90.0  # imports, the CA, the listeners; re-forming its rings goes on after it answers


@dataclass(frozen=True)
class ServiceInfo:
    """What ``fleet-service.json`` says about the running service."""

    pid: int
    admin_socket: Path
    admin_url: str | None
    api_url: str | None
    started_at: float


def read_service_file(state_dir: Path) -> ServiceInfo | None:
    """The service file's contents, or None when there is none or it does not read (a service that
    died mid-write leaves a stale or partial file: the console then starts a new service)."""
    path = Path(state_dir) / SERVICE_FILE
    try:
        blob = json.loads(path.read_text(encoding="utf-8"))
        return ServiceInfo(int(blob["pid"]), Path(blob.get("admin_socket") or Path(state_dir) / SOCKET_FILE),
                           blob.get("admin_url"), blob.get("api_url"), float(blob.get("started_at", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        import psutil

        return bool(psutil.pid_exists(pid)) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    except psutil.Error:  # NoSuchProcess between the two calls, AccessDenied reading the status
        return False


def service_command(state_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """The command line of a local fleet service over ``state_dir``."""
    return [sys.executable, "-m", "engine.cli.main", "fleet", "run", "--state-dir", str(state_dir), *extra]


def start_detached(command: Sequence[str], log_path: Path) -> subprocess.Popen:
    """Start ``command`` so that it outlives this process and its terminal."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        kwargs: dict = {"stdin": subprocess.DEVNULL, "stdout": log, "stderr": subprocess.STDOUT, "close_fds": True}
        if sys.platform == "win32":
            kwargs["creationflags"] = (subprocess.CREATE_NEW_PROCESS_GROUP  # type: ignore[attr-defined]
                                       | subprocess.DETACHED_PROCESS)  # type: ignore[attr-defined]
        else:
            kwargs["start_new_session"] = True  # no SIGHUP/SIGINT from the console's terminal or session
        return subprocess.Popen(list(command), **kwargs)


async def async_wait_for_service(state_dir: Path, *, timeout: float = START_TIMEOUT_S,
                                 process: subprocess.Popen | None = None) -> tuple[AdminClient, ServiceInfo]:
    """A client over the local service's socket once it answers ``GET /service``; the service's
    log tail in the error if it exits first or does not answer within ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServiceUnreachableError(f"the fleet service exited with code {process.returncode} while starting; "
                                          f"its log: {_tail(Path(state_dir) / LOG_FILE)}")
        info = read_service_file(state_dir)
        if info is not None and pid_alive(info.pid) and info.admin_socket.exists():
            client = AdminClient.over_socket(info.admin_socket)
            try:
                await client.async_service()
                return client, info
            except AdminApiError as exc:
                last = exc
                await client.async_close()
        await asyncio.sleep(0.2)
    raise ServiceUnreachableError(f"the fleet service over {state_dir} did not answer within {timeout:g} s"
                                  f" ({last or 'no admin socket'}); its log: {_tail(Path(state_dir) / LOG_FILE)}")


async def async_attach_local(state_dir: Path, *, start: bool = True, extra_args: Sequence[str] = (),
                             timeout: float = START_TIMEOUT_S) -> tuple[AdminClient, ServiceInfo, bool]:
    """(client, info, started): the running local service's, or a new detached one's (``start``)."""
    state_dir = Path(state_dir)
    info = read_service_file(state_dir)
    if info is not None and pid_alive(info.pid):
        client, info = await async_wait_for_service(state_dir, timeout=min(timeout, 15.0))
        return client, info, False
    if not start:
        raise ServiceUnreachableError(f"no fleet service runs over {state_dir}; start one with "
                                      f"`deskfleet fleet --state-dir {state_dir}`")
    state_dir.mkdir(parents=True, exist_ok=True)
    process = start_detached(service_command(state_dir, extra_args), state_dir / LOG_FILE)
    client, info = await async_wait_for_service(state_dir, timeout=timeout, process=process)
    return client, info, True


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return "(none)"
    return " | ".join(text[-lines:]) or "(empty)"
