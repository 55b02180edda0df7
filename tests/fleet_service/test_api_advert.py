"""The fleet service advertises its OpenAI API over mDNS on loopback: a browser finds the record of
its fleet (address, port, path) and ignores what is not a Deskfleet API record."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from console.fleet.api_advert import ApiAdvertError, ApiAdvertisement, async_find_api
from tests.fleet_service.conftest import service_in_process
from tests.support.asyncutil import run

pytestmark = pytest.mark.usefixtures("private_keyring")


def test_the_service_advertises_its_api(tmp_path, monkeypatch):
    read: dict[asyncio.Task, list[str]] = {}  # per lookup, the fleet of each record it read back as an API's
    from_record = ApiAdvertisement.from_record.__func__

    def spy(cls, properties, port, address):
        ad = from_record(cls, properties, port, address)
        read.setdefault(asyncio.current_task(), []).append(ad.fleet_id)
        return ad

    monkeypatch.setattr(ApiAdvertisement, "from_record", classmethod(spy))

    async def main():
        async with service_in_process(tmp_path / "fleet", advertise_api=True) as service:
            ours = service.fleet.fleet_id
            ad = await async_find_api("127.0.0.1", ours, timeout=10)
            assert ad is not None and f"{ad.url}" == service.api_url
            # Another fleet's lookup reads our record and goes on looking: followed until it has
            # read it (the browser's answer), not waited out to its timeout.
            other = asyncio.create_task(async_find_api("127.0.0.1", "0" * 16, timeout=30))
            try:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while ours not in read.get(other, []):
                    assert not other.done(), f"the other fleet's lookup ended with {other.result()}"
                    assert loop.time() < deadline, "the other fleet's lookup did not read the record in 10 s"
                    await asyncio.sleep(0.02)
                # one that took our record would now return it (within milliseconds); this one goes on
                await asyncio.wait({other}, timeout=0.5)
                assert not other.done(), f"another fleet's lookup returned {other.result()}: not ours"
            finally:
                other.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await other

    run(main(), 60)


def test_a_record_that_is_not_ours_is_refused():
    ok = {b"fleet": b"0123456789abcdef", b"path": b"/v1", b"tls": b"0"}
    assert ApiAdvertisement.from_record(ok, 8000, "10.0.0.2").url == "http://10.0.0.2:8000/v1"
    for bad in ({**ok, b"fleet": b"xyz"}, {**ok, b"tls": b"yes"}, {**ok, b"path": b"v1; rm"}, {}):
        with pytest.raises(ApiAdvertError):
            ApiAdvertisement.from_record(bad, 8000, "10.0.0.2")
    with pytest.raises(ApiAdvertError):
        ApiAdvertisement.from_record(ok, 0, "10.0.0.2")
