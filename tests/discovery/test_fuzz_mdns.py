"""Hostile mDNS records published by a fake peer through real zeroconf, seen by a real Browser (issue 7).

Both bound to 127.0.0.1 only. Each hypothesis example publishes a batch of raw
``zeroconf.ServiceInfo`` records at once (no probing): TXT properties mutated around a valid
record or raw TXT bytes, random ports, 0-10 addresses of any kind, random SRV targets. The record
as it goes on the wire (its TXT bytes) is parsed locally to say what the browser must conclude:
a valid record must show up among the peers with that advertisement, an invalid one must never
show up and must be logged. Nothing may crash the browser (no ERROR log, no failed resolution
task), and a genuine agent is still found afterwards. ``tests/discovery/test_discovery.py`` fuzzes the pure
parser; this is the same rules through the network.

Every name carries ``RUN``, a token fresh in each process: multicast on 127.0.0.1 is shared by every
process on the machine, and another run of this module (the same derandomized examples, or another
version of this file with other ones) publishes its own records under the same serials. Without the
token the browser rightly shows that run's honest ``fz577-`` where this run sent a hostile one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from engine.discovery.mdns import (
    SERVICE_TYPE,
    TXT_KEYS,
    Advertisement,
    Advertiser,
    AgentState,
    Browser,
)
from engine.errors import DiscoveryError
from tests.support.fuzz_helpers import fuzz_settings, loop_thread

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning"),
]

BATCH = 25
EXAMPLES = 24
CASES = {"mDNS: TXT records from a fake peer through zeroconf": BATCH * EXAMPLES}
SETTLE_S = 15.0
_serial = itertools.count()
RUN = secrets.token_hex(4)  # names unique across processes, not only within this one

VALID = Advertisement(instance="template", node_id="ab:cd", fleet_id="fleet-1", version="0.1.0",
                      devices=("CPU", "GPU.0"), memory_bytes=16 << 30, state=AgentState.IDLE, control_port=8443)
VALID_TXT = {k.encode(): v.encode() for k, v in VALID.to_properties().items()}
keys = st.sampled_from([k.encode() for k in TXT_KEYS]) | st.binary(max_size=10) \
    | st.sampled_from([b"id=x", b"", b"ID", b"\xff", b"st "])
values = st.none() | st.binary(max_size=60) | st.sampled_from(
    [b"", b"1", b"2", b"idle", b"serving", b"CPU,CPU", b"CPU,,GPU", b"-5", b"18446744073709551616", b"\xff\xfe",
     b"not-joined", b"\x00", b"a" * 251, b"\xd9\xa1", b"1_000", b"0x10"])
addresses = st.lists(st.sampled_from(["127.0.0.1", "10.0.0.7", "0.0.0.0", "224.0.0.251", "255.255.255.255",
                                      "192.168.1.20", "127.0.0.2", "8.8.8.8"]), min_size=0, max_size=10,
                     unique=True)


@st.composite
def records(draw):
    """(instance, ServiceInfo) of one hostile record; instance names are unique per record and per run."""
    suffix = draw(st.text(st.characters(codec="ascii", categories=("L", "N")), max_size=8))
    instance = f"fz{RUN}-{next(_serial)}-{suffix}"
    name = f"{instance}.{SERVICE_TYPE}"
    honest = draw(st.integers(0, 9)) < 3  # a valid record, perhaps with keys a newer agent might add
    if honest:
        properties = {**VALID_TXT, **draw(st.dictionaries(st.sampled_from([b"new", b"x-y", b"zz"]), values,
                                                          max_size=2))}
    elif draw(st.integers(0, 9)) == 0:
        text = draw(st.binary(max_size=400) | st.lists(st.binary(max_size=80), max_size=12).map(
            lambda parts: b"".join(bytes([len(p)]) + p for p in parts)))
        properties = text or b"\x00"
    else:
        props = {k: v for k, v in {**VALID_TXT, **draw(st.dictionaries(keys, values, max_size=6))}.items()
                 if k not in draw(st.sets(keys, max_size=2))}
        if draw(st.integers(0, 19)) == 0:
            props.update({f"pad{i}".encode(): b"z" * 240 for i in range(draw(st.integers(1, 8)))})
        properties = props
    port = draw(st.integers(1, 65535) if honest else st.sampled_from([8443, 1, 65535, 0]) | st.integers(0, 65535))
    server = draw(st.sampled_from([f"{instance}.local.", f"host-{instance}.local."]))
    honest_addresses = st.lists(st.sampled_from(["127.0.0.1", "10.0.0.7", "192.168.1.20"]), min_size=1, max_size=3,
                                unique=True)
    listed = draw(honest_addresses if honest else addresses.filter(bool) if draw(st.integers(0, 19)) else addresses)
    try:
        info = ServiceInfo(SERVICE_TYPE, name, port=port, properties=properties, server=server,
                           parsed_addresses=listed, host_ttl=120, other_ttl=120)
    except Exception:  # zeroconf will not even encode it (a TXT string over 255 bytes): send the template
        info = ServiceInfo(SERVICE_TYPE, name, port=port, properties=VALID_TXT, server=server,
                           parsed_addresses=listed, host_ttl=120, other_ttl=120)
    return instance, info


def verdict(info: ServiceInfo) -> Advertisement | None:
    """What the browser must make of a record: the record as it travels (its TXT bytes) parsed here."""
    wire = ServiceInfo(SERVICE_TYPE, info.name, port=info.port, properties=info.text, server=info.server,
                       parsed_addresses=info.parsed_addresses(IPVersion.V4Only))
    try:
        ad = Advertisement.from_service_info(wire)
    except DiscoveryError:
        return None
    return ad if ad.addresses else None  # no A record: the browser cannot resolve it, and says so


def same(a: Advertisement, b: Advertisement) -> bool:
    return replace(a, addresses=tuple(sorted(a.addresses))) == replace(b, addresses=tuple(sorted(b.addresses)))


class Heard(logging.Handler):
    """Every message the discovery module logs, for the test to wait on."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().lower())
        if record.levelno >= logging.ERROR:
            self.errors.append(record.getMessage())


@pytest.fixture(scope="module")
def live():
    heard = Heard()
    logger = logging.getLogger("engine.discovery.mdns")
    logger.addHandler(heard)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    snapshots: list[dict] = []
    try:
        with loop_thread() as loop:
            browser = Browser("127.0.0.1", on_change=snapshots.append, resolve_timeout=1.0)
            loop.run(browser.async_start())
            peer = loop.run(_async_zeroconf())
            try:
                yield loop, browser, peer, heard, snapshots
            finally:
                loop.run(peer.async_close())
                loop.run(browser.async_close())
    finally:
        logger.removeHandler(heard)
        logger.setLevel(old_level)


async def _async_zeroconf() -> AsyncZeroconf:
    return AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)


async def _publish(peer: AsyncZeroconf, infos: list[ServiceInfo]) -> list[ServiceInfo]:
    """Register every record at once, as a cooperating responder (no probing); returns those zeroconf
    agreed to send."""
    async def one(info):
        try:
            return info, await peer.async_register_service(info, cooperating_responders=True)
        except Exception:  # zeroconf itself refuses to build or send it: nothing reaches the browser
            return info, None

    registered = await asyncio.gather(*(one(i) for i in infos))
    await asyncio.gather(*(task for _, task in registered if task is not None), return_exceptions=True)
    return [info for info, task in registered if task is not None]


async def _withdraw(peer: AsyncZeroconf, infos: list[ServiceInfo]) -> None:
    tasks = [await peer.async_unregister_service(i) for i in infos]
    await asyncio.gather(*tasks, return_exceptions=True)


def test_fuzz_hostile_records_through_real_zeroconf(live):
    loop, browser, peer, heard, snapshots = live
    ran, outcomes = [], {"accepted": 0, "ignored": 0, "unsent": 0}
    verdicts: dict[str, Advertisement | None] = {}

    @fuzz_settings(EXAMPLES)
    @given(batch=st.lists(records(), min_size=BATCH, max_size=BATCH))
    def case(batch):
        ran.extend(batch)
        infos = [info for _, info in batch]
        sent = loop.run(_publish(peer, infos))
        outcomes["unsent"] += len(infos) - len(sent)
        expected = {info.name[: -len("." + SERVICE_TYPE)]: verdict(info) for info in sent}
        verdicts.update(expected)
        deadline = time.monotonic() + SETTLE_S
        try:
            while True:
                peers = browser.peers()
                pending = [i for i, ad in expected.items()
                           if (ad is None and not any(f"'{i.lower()}." in m for m in heard.messages))
                           or (ad is not None and not (i in peers and same(peers[i].advertisement, ad)))]
                if not pending:
                    break
                assert time.monotonic() < deadline, f"the browser never settled on {pending[:3]}: " \
                    f"{[(p, expected[p], peers.get(p)) for p in pending[:2]]}"
                time.sleep(0.05)
            for instance, ad in expected.items():
                if ad is None:
                    assert instance not in browser.peers(), f"malformed {instance} was accepted"
            outcomes["accepted"] += sum(ad is not None for ad in expected.values())
            outcomes["ignored"] += sum(ad is None for ad in expected.values())
        finally:
            loop.run(_withdraw(peer, sent))

    case()
    assert len(ran) >= CASES["mDNS: TXT records from a fake peer through zeroconf"]
    assert not heard.errors, heard.errors[:3]
    assert outcomes["accepted"] >= 50 and outcomes["ignored"] >= 200, outcomes
    assert outcomes["unsent"] <= 0.1 * len(ran), outcomes
    shown = {i for snapshot in snapshots for i in snapshot if i in verdicts}  # other agents on lo are not ours
    wrong = [(i, [sn[i].advertisement for sn in snapshots if i in sn][:1]) for i in shown if verdicts[i] is None]
    assert not wrong, f"on_change showed peers it should have ignored: {wrong[:3]}"

    # A genuine agent is still found, and the hostile ones are gone.
    real = Advertiser("127.0.0.1")
    genuine = replace(VALID, instance=f"genuine-{RUN}-{next(_serial)}", addresses=())

    async def genuine_is_found():
        published = await real.async_start(genuine)
        try:
            while genuine.instance not in browser.peers():
                await asyncio.sleep(0.05)
            return browser.peers()[genuine.instance].advertisement == published
        finally:
            await real.async_close()

    assert loop.run(genuine_is_found(), 30)
