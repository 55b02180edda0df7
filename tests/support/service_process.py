"""A ``deskfleet fleet`` service process for tests and benchmarks (tests/fleet_service/test_service_restart.py,
tests/benchmarks/rings_service.py): started on a state dir with fixed loopback ports, reached over its
admin socket, killed or stopped; and a wait for one of its rings to serve."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.fleet_service.admin import Admin
from tests.support.loopback import free_port


class ServiceProcess:
    """``deskfleet fleet`` on a state dir with fixed loopback ports (as a real install has);
    ``admin_port`` -1: no admin port over TLS, only the local socket. ``mdns`` False: the service
    neither advertises nor browses (``--no-mdns``): a benchmark's fleet is then invisible to tests
    that browse loopback meanwhile."""

    def __init__(self, state: Path, log: Path, *, admin_port: int = -1, python_args: tuple[str, ...] = (),
                 code: Path | None = None, mdns: bool = True, interface: str = "127.0.0.1",
                 threads: int | None = 1, exact: bool = True,
                 launch: Callable[[list[str]], list[str]] | None = None,
                 preexec: Callable[[], None] | None = None) -> None:
        self.state, self.log = state, log
        self.python_args = python_args  # before ``-m engine.cli.main``: e.g. ("-m", "cProfile", "-o", PATH)
        self.code = code  # another source tree to run the service from (a benchmark's baseline)
        self.ports = {"--api-port": free_port(), "--enrollment-port": free_port(), "--hub-port": free_port(),
                      "--data-port": free_port(), "--admin-port": admin_port}
        self.proc: asyncio.subprocess.Process | None = None
        self.mdns = mdns
        # another host's view (the emulated office): the address, the workers' threads (None: each PC's
        # own cores decide), ``launch`` wraps the argv (into a namespace), ``preexec`` joins cgroups
        self.interface, self.threads, self.exact = interface, threads, exact
        self.launch, self.preexec = launch, preexec

    async def start(self, timeout: float = 60.0) -> Admin:
        args = [sys.executable, *self.python_args, "-m", "engine.cli.main", "fleet", "--state-dir", str(self.state),
                "--interface", self.interface]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        if self.exact:
            args.append("--exact")
        for flag, port in self.ports.items():
            args += [flag, str(port)]
        if not self.mdns:
            args.append("--no-mdns")
        with self.log.open("ab") as out:
            env = None if self.code is None else {**os.environ, "PYTHONPATH": str(self.code)}
            if self.launch is not None:
                args = self.launch(args)
            self.proc = await asyncio.create_subprocess_exec(*args, stdout=out, stderr=out, env=env, cwd=self.code,
                                                             stdin=asyncio.subprocess.DEVNULL, preexec_fn=self.preexec)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.returncode is None, f"the service exited {self.proc.returncode}:\n{self.log.read_text()}"
            if (self.state / "fleet-service.json").exists():
                admin = Admin.unix(self.state / "admin.sock")
                with contextlib.suppress(OSError, Exception):
                    await admin.ok("GET", "/service", timeout=5)
                    return admin
                await admin.close()
            assert time.monotonic() < deadline, f"the service did not start in {timeout:g} s:\n{self.log.read_text()}"
            await asyncio.sleep(0.2)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.proc.wait(), 10)

    async def stop(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def ring_serving(admin: Admin, ring: str, timeout: float) -> dict:
    """The ring's record once its phase is *serving* (an assertion naming the last answer after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = await admin.call("GET", f"/rings/{ring}")
        if status == 200 and body["ring"]["phase"] == "serving":
            return body["ring"]
        assert time.monotonic() < deadline, f"ring {ring} not serving after {timeout:g} s: {body}"
        await asyncio.sleep(0.2)
