"""The fleet service advertises its OpenAI API over mDNS on loopback: a browser finds the record of
its fleet (address, port, path) and ignores what is not a Deskfleet API record."""

from __future__ import annotations

import pytest

from console.service.api_advert import ApiAdvertError, ApiAdvertisement, async_find_api
from tests.fleet_service.conftest import service_in_process
from tests.support.asyncutil import run

pytestmark = pytest.mark.usefixtures("private_keyring")


def test_the_service_advertises_its_api(tmp_path):
    async def main():
        async with service_in_process(tmp_path / "fleet", advertise_api=True) as service:
            ad = await async_find_api("127.0.0.1", service.fleet.fleet_id, timeout=10)
            assert ad is not None and f"{ad.url}" == service.api_url
            assert await async_find_api("127.0.0.1", "0" * 16, timeout=1.5) is None  # another fleet: not ours

    run(main(), 60)


def test_a_record_that_is_not_ours_is_refused():
    ok = {b"fleet": b"0123456789abcdef", b"path": b"/v1", b"tls": b"0"}
    assert ApiAdvertisement.from_record(ok, 8000, "10.0.0.2").url == "http://10.0.0.2:8000/v1"
    for bad in ({**ok, b"fleet": b"xyz"}, {**ok, b"tls": b"yes"}, {**ok, b"path": b"v1; rm"}, {}):
        with pytest.raises(ApiAdvertError):
            ApiAdvertisement.from_record(bad, 8000, "10.0.0.2")
    with pytest.raises(ApiAdvertError):
        ApiAdvertisement.from_record(ok, 0, "10.0.0.2")
