"""Fixtures for the fleet service tests: a service in this process on loopback (no mDNS browser)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from console.service.console_settings import ConsoleSettings
from console.service.fleet_service import FleetService, FleetServiceSettings


@contextlib.asynccontextmanager
async def service_in_process(state_dir: Path, **kw):
    """A started FleetService with every port chosen by the OS (admin TLS too); closed after."""
    console = ConsoleSettings(state_dir, api_port=0, enrollment_port=0, hub_port=0, data_port=0, refresh_s=0.5)
    kw.setdefault("advertise_api", False)
    service = FleetService(FleetServiceSettings(console, admin_port=0, browse=False, **kw))
    await service.async_start()
    try:
        yield service
    finally:
        await service.async_close(stop_workers=True)
