"""Discovery: the advertisement's validation (pure, fuzzed) and real zeroconf on loopback.

Live tests bind zeroconf to 127.0.0.1 / 127.0.0.2 only (both on ``lo``): nothing reaches the
real network. Registration probes for ~1.7 s, so the live tests share one loop and one browser.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from engine.discovery.mdns import (
    MAX_TXT_BYTES,
    RECORD_TTL_S,
    SERVICE_TYPE,
    TXT_KEYS,
    Advertisement,
    Advertiser,
    AgentState,
    Browser,
    instance_name,
    new_instance_name,
)
from engine.errors import DiscoveryError
from tests.support.asyncutil import until


def make_ad(instance: str | None = None, **changes) -> Advertisement:
    ad = Advertisement(instance=new_instance_name("test") if instance is None else instance, node_id="ab:cd:ef",
                       fleet_id="fleet-1", version="0.1.0", devices=("CPU", "GPU.0"),
                       memory_bytes=16 * 2**30, state=AgentState.IDLE, control_port=8443,
                       addresses=("127.0.0.1",))
    return replace(ad, **changes)


def info_for(ad: Advertisement, properties=None, **overrides) -> ServiceInfo:
    kwargs = dict(port=ad.control_port, parsed_addresses=list(ad.addresses), server=ad.service_name,
                  properties=ad.to_properties() if properties is None else properties)
    kwargs.update(overrides)
    return ServiceInfo(SERVICE_TYPE, ad.service_name, **kwargs)


# -- pure: the record and its validation ----------------------------------------------------------

def test_record_round_trips_through_service_info():
    ad = make_ad(state=AgentState.SERVING, devices=("CPU", "GPU.0", "NPU"))
    assert Advertisement.from_service_info(info_for(ad)) == ad


def test_unjoined_agent_without_devices_round_trips():
    ad = make_ad(node_id="", fleet_id="", devices=(), state="not-joined")
    back = Advertisement.from_service_info(info_for(ad))
    assert back == ad and back.state is AgentState.NOT_JOINED


def test_largest_valid_record_fits_the_txt_budget():
    ad = make_ad(node_id="f" * 128, fleet_id="e" * 128, version="v" * 32,
                 devices=tuple(f"GPU.{i:02d}" for i in range(16)), memory_bytes=2**63 - 1)
    assert len(info_for(ad).text) < MAX_TXT_BYTES


@pytest.mark.parametrize(("change", "field"), [
    ({"instance": ""}, "instance"), ({"instance": "a.b"}, "instance"),
    ({"instance": "x" * 64}, "instance"), ({"node_id": "bad id"}, "node id"),
    ({"fleet_id": "f" * 129}, "fleet id"), ({"version": ""}, "version"),
    ({"devices": ("CPU", "CPU")}, "device list"), ({"devices": ("C PU",)}, "device name"),
    ({"devices": ["CPU"]}, "device list"), ({"memory_bytes": -1}, "memory"),
    ({"memory_bytes": True}, "memory"), ({"state": "asleep"}, "state"),
    ({"control_port": 0}, "control port"), ({"control_port": 70000}, "control port"),
    ({"addresses": ("::1",)}, "address"), ({"addresses": ("0.0.0.0",)}, "address"),
    ({"devices": tuple(f"DEVICE-NAME-{i:03d}" for i in range(16))}, "TXT value 'dev'"),
])
def test_invalid_local_advertisement_is_refused(change, field):
    with pytest.raises(DiscoveryError, match=field):
        make_ad(**change)


@pytest.mark.parametrize(("props", "field"), [
    ({"st": None}, "'st'"), ({"mem": "12x"}, "memory"), ({"mem": "+12"}, "memory"),
    ({"mem": "1_000"}, "memory"), ({"mem": "\u0661"}, "'mem'"), ({"txtvers": "2"}, "TXT version"),
    ({"dev": "CPU,,GPU"}, "device name"), ({"ver": b"\xff\xfe"}, "'ver'"),
    ({"id": "x" * 240}, "node id"), ({"st": "s" * 251}, "'st'.*longer"),
])
def test_hostile_txt_fields_raise_discovery_error(props, field):
    good = {k.encode(): v.encode() for k, v in make_ad().to_properties().items()}
    for key, value in props.items():
        good[key.encode()] = value.encode() if isinstance(value, str) else value
    with pytest.raises(DiscoveryError, match=field):
        Advertisement.from_service_info(info_for(make_ad(), properties=good))


def test_missing_key_port_and_oversized_record_are_refused():
    ad = make_ad()
    props = ad.to_properties()
    del props["fl"]
    with pytest.raises(DiscoveryError, match="'fl'.*missing"):
        Advertisement.from_service_info(info_for(ad, properties=props))
    with pytest.raises(DiscoveryError, match="control port"):
        Advertisement.from_service_info(info_for(ad, port=None))
    padded = {**ad.to_properties(), **{f"x{i}": "p" * 200 for i in range(6)}}
    with pytest.raises(DiscoveryError, match="exceeds"):
        Advertisement.from_service_info(info_for(ad, properties=padded))


def test_unknown_keys_from_a_newer_agent_are_ignored():
    ad = make_ad()
    assert Advertisement.from_service_info(info_for(ad, properties={**ad.to_properties(),
                                                                   "gpu": "arc"})) == ad


@pytest.mark.parametrize(("label", "expected"), [
    ("pc42.corp.example.com", "pc42-corp-example-com-abcd1234"),   # a dot would split the label
    ("Ana's PC\t(2)", "Ana's PC-(2)-abcd1234"),
    ("...", "agent-abcd1234"),
])
def test_instance_name_from_any_pc_name(label, expected):
    assert instance_name(label, "abcd1234") == expected


@pytest.mark.slow
@given(label=st.text(max_size=100))
def test_instance_name_always_fits_one_dns_label(label):
    name = instance_name(label, "abcd1234")
    assert len(name.encode()) <= 63 and name.endswith("-abcd1234")
    assert make_ad(instance=name).instance == name


def test_interface_must_be_one_explicit_ipv4_address():
    for bad in ("0.0.0.0", "", "eth0", "::1", "224.0.0.251", None):
        with pytest.raises(DiscoveryError):
            Advertiser(bad)
        with pytest.raises(DiscoveryError):
            Browser(bad)


_VALID = {k.encode(): v.encode() for k, v in make_ad().to_properties().items()}
_keys = st.sampled_from([k.encode() for k in TXT_KEYS]) | st.binary(min_size=0, max_size=12)
_values = st.none() | st.binary(max_size=230) | st.sampled_from(
    [b"", b"1", b"0", b"idle", b"CPU,GPU.0", b"18446744073709551616", b"99999999999999999999"])


def _accepts_or_raises_discovery_error(info: ServiceInfo) -> None:
    try:
        ad = Advertisement.from_service_info(info)
    except DiscoveryError:
        return
    assert ad.to_properties() == {k: info.properties[k.encode()].decode() for k in TXT_KEYS}


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.dictionaries(_keys, _values, max_size=8), drop=st.sets(_keys, max_size=3),
       port=st.none() | st.integers(0, 70000),
       instance=st.text(min_size=1, max_size=70))
def test_fuzz_from_service_info_raises_only_discovery_error(mutations, drop, port, instance):
    """Random dicts near a valid record (so the checks past the first one are reached too)."""
    props = {k: v for k, v in {**_VALID, **mutations}.items() if k not in drop}
    try:
        info = ServiceInfo(SERVICE_TYPE, f"{instance}.{SERVICE_TYPE}", port=port,
                           properties=props, parsed_addresses=["127.0.0.1"])
    except Exception:  # zeroconf itself refuses to build this one: nothing to parse
        return
    _accepts_or_raises_discovery_error(info)


@settings(max_examples=200, deadline=None)
@given(text=st.binary(max_size=1500))
def test_fuzz_raw_txt_bytes_raise_only_discovery_error(text):
    info = ServiceInfo(SERVICE_TYPE, f"raw.{SERVICE_TYPE}", port=1, properties=text,
                       parsed_addresses=["127.0.0.1"])
    _accepts_or_raises_discovery_error(info)


# -- live: real zeroconf bound to loopback ---------------------------------------------------------

@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(loop, coro, timeout: float = 30):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def browser(loop):
    """One browser on 127.0.0.1 for the module; ``browser.changes`` records on_change calls."""
    changes: list[dict] = []
    b = Browser("127.0.0.1", on_change=changes.append)
    b.changes = changes
    run(loop, b.async_start())
    yield b
    run(loop, b.async_close())


def test_advertiser_is_found_updated_and_withdrawn(loop, browser):
    ad = make_ad(addresses=())   # the advertiser fills in its interface
    advertiser = Advertiser("127.0.0.1")

    async def scenario():
        published = await advertiser.async_start(ad)
        assert published.addresses == ("127.0.0.1",)
        await until(lambda: ad.instance in browser.peers(), "the advertiser to be found")
        peer = browser.peers()[ad.instance]
        assert peer.advertisement == published
        assert peer.last_seen <= time.monotonic()
        # Records arrive with the short TTL, so a crashed agent (no goodbye) leaves in ~2 min.
        cached = browser._zc.zeroconf.cache.async_entries_with_name(ad.service_name)
        assert cached and {r.ttl for r in cached} == {RECORD_TTL_S}

        n = len(browser.changes)
        serving = await advertiser.async_update(replace(published, state=AgentState.SERVING,
                                                        fleet_id="fleet-2", node_id="11:22"))
        await until(lambda: browser.peers()[ad.instance].advertisement == serving,
                    "the update to be seen")
        assert browser.changes[-1][ad.instance].advertisement == serving
        assert len(browser.changes) > n
        with pytest.raises(ValueError):
            await advertiser.async_update(replace(serving, instance="someone-else"))

        await advertiser.async_close()
        await until(lambda: ad.instance not in browser.peers(), "the goodbye to drop it",
                    timeout=3.0)   # well under the 120 s TTL: goodbye packets, not expiry
        assert ad.instance not in browser.changes[-1]

    try:
        run(loop, scenario())
    finally:
        run(loop, advertiser.async_close())


@pytest.mark.slow
def test_two_advertisers_side_by_side_on_their_own_interfaces(loop, browser):
    first, second = make_ad(control_port=9001), make_ad(control_port=9002, addresses=())
    a1, a2 = Advertiser("127.0.0.1"), Advertiser("127.0.0.2")

    async def scenario():
        await asyncio.gather(a1.async_start(first), a2.async_start(second))
        await until(lambda: {first.instance, second.instance} <= set(browser.peers()),
                    "both advertisers")
        peers = browser.peers()
        assert peers[first.instance].advertisement == first
        assert peers[second.instance].advertisement.addresses == ("127.0.0.2",)
        assert peers[second.instance].advertisement.control_port == 9002
        await a2.async_close()
        await until(lambda: second.instance not in browser.peers(), "the second to leave")
        assert first.instance in browser.peers()

    try:
        run(loop, scenario())
    finally:
        run(loop, a1.async_close())
        run(loop, a2.async_close())


def test_hostile_records_are_ignored_and_logged_once(loop, browser, caplog):
    """Raw zeroconf publishes bad TXT records next to valid ones; the browser survives."""
    good = make_ad()
    turncoat = make_ad()
    hostile = {
        "no-keys": {"hello": "world"},
        "bad-state": {**good.to_properties(), "st": "rm -rf"},
        "huge": {**good.to_properties(), **{f"k{i}": "z" * 240 for i in range(8)}},
        "binary": {**good.to_properties(), "ver": b"\xff\x00\xfe"},
    }
    raw = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    infos = [ServiceInfo(SERVICE_TYPE, f"{name}-{good.instance}.{SERVICE_TYPE}", port=1,
                         properties=props, parsed_addresses=["127.0.0.1"])
             for name, props in hostile.items()]

    async def publish(info):
        await (await raw.async_register_service(info, cooperating_responders=True))

    async def scenario():
        await asyncio.gather(*(publish(i) for i in infos))
        await publish(info_for(turncoat))
        await publish(info_for(good))
        await until(lambda: {good.instance, turncoat.instance} <= set(browser.peers()),
                    "the valid peers next to the hostile ones")
        await asyncio.sleep(0.3)
        assert not any(name in instance for instance in browser.peers() for name in hostile)

        # A valid peer that turns malformed is dropped, not kept with stale data.
        bad = info_for(turncoat, properties={**turncoat.to_properties(), "mem": "-5"})
        await (await raw.async_update_service(bad))
        await until(lambda: turncoat.instance not in browser.peers(), "the turncoat dropped")
        # ...and its next bad announcement is logged at DEBUG only.
        worse = info_for(turncoat, properties={**turncoat.to_properties(), "mem": "-6"})
        await (await raw.async_update_service(worse))
        await asyncio.sleep(0.5)
        assert good.instance in browser.peers()

    caplog.set_level(logging.DEBUG, logger="engine.discovery.mdns")
    try:
        run(loop, scenario())
    finally:
        run(loop, raw.async_close())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in hostile:
        assert sum(f"{name}-{good.instance}" in w for w in warnings) == 1, (name, warnings)
    turncoat_logs = [r for r in caplog.records if turncoat.instance in r.getMessage()]
    assert [r.levelno for r in turncoat_logs][:2] == [logging.WARNING, logging.DEBUG]


def test_binding_an_address_this_machine_lacks_is_a_clear_error(loop):
    advertiser = Advertiser("192.0.2.1")   # TEST-NET-1: never assigned to a real host
    with pytest.raises(DiscoveryError, match="192.0.2.1"):
        run(loop, advertiser.async_start(make_ad()))
