"""``FleetService.async_open`` builds every part before the service exists; a part that fails closes
what was built: the state dir is free for the next open (its lock, keys and ports released) and no
service file points a console at a service that is not there."""

from __future__ import annotations

import socket

import pytest

from console.fleet.fleet_service import FleetService, FleetServiceSettings
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.fleet_settings import FleetSettings
from console.fleet_api.service_locator import SERVICE_FILE
from tests.support.asyncutil import run

pytestmark = pytest.mark.usefixtures("private_keyring")


def _settings(state_dir, admin_port: int) -> FleetServiceSettings:
    fleet = FleetSettings(state_dir, api_port=0, enrollment_port=0, hub_port=0, data_port=0, refresh_s=0.5)
    return FleetServiceSettings(fleet, admin_port=admin_port, browse=False, advertise_api=False, advertise=False)


def test_a_failed_open_closes_what_it_built_and_the_next_open_serves(tmp_path):
    state = tmp_path / "fleet"

    async def main():
        with socket.socket() as busy:  # the admin port asked for is taken: the open fails after host and API
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            with pytest.raises(FleetServiceError, match="admin API cannot listen"):
                await FleetService.async_open(_settings(state, busy.getsockname()[1]))
        assert not (state / SERVICE_FILE).exists()
        service = await FleetService.async_open(_settings(state, 0))
        try:
            assert (state / SERVICE_FILE).exists()
            assert service.admin_url is not None and service.api_url.startswith("http://127.0.0.1:")
            assert list(service.fleet.records()) == []
        finally:
            await service.async_close()
        assert not (state / SERVICE_FILE).exists()

    run(main(), 120)
