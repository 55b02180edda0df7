"""Fixtures for the fleet service tests: a service in this process on loopback (no mDNS browser)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from console.fleet.fleet_service import FleetService, FleetServiceSettings
from console.fleet_api.fleet_settings import FleetSettings
from engine.envvars import KEYRING_DIR
from tests.support.shared_loop import SharedLoop


@contextlib.asynccontextmanager
async def service_in_process(state_dir: Path, **kw):
    """A started FleetService with every port chosen by the OS (admin TLS too); closed after."""
    console = FleetSettings(state_dir, api_port=0, enrollment_port=0, hub_port=0, data_port=0, refresh_s=0.5)
    kw.setdefault("advertise_api", False)
    service = await FleetService.async_open(FleetServiceSettings(console, admin_port=0, browse=False, **kw))
    try:
        yield service
    finally:
        await service.async_close(stop_workers=True)


class SharedService:
    """One default service (``service_in_process``) on a loop thread, for the tests of a module
    that need no settings of their own and leave nothing another would trip on (a start and a
    close cost ~2 s, most of it the enrolment record's mDNS probing and goodbye)."""

    def __init__(self, loop: SharedLoop, service: FleetService) -> None:
        self.loop, self.service = loop, service

    def run(self, coro, timeout: float, what: str = "the test"):
        return self.loop.run(coro, timeout, what)


@pytest.fixture(scope="module")
def shared_service_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-service")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(KEYRING_DIR, str(root / "keyring"))  # the service's own, for the module's length
        loop = SharedLoop("test-shared-service").start()
        running = service_in_process(root / "fleet")
        try:
            service = loop.run(running.__aenter__(), 60, "starting the service")
            try:
                yield SharedService(loop, service)
            finally:
                loop.run(running.__aexit__(None, None, None), 60, "closing the service")
        finally:
            loop.stop()


@pytest.fixture
def shared_service(shared_service_module) -> SharedService:
    """The module's service; its loop's executor is this test's own (tests/support/shared_loop.py)."""
    shared_service_module.loop.new_executor()
    yield shared_service_module
    shared_service_module.loop.new_executor()
