"""The console's fleet model over real agents on loopback: mDNS discovery (zeroconf bound to
127.0.0.1), unicast registration at the hub, add by address, approvals persisted in the console
state dir, another fleet's agent refused, remote pause seen by polling and by hub event, and an
unreachable agent marked rather than dropped. Real TLS, real aiohttp, real zeroconf."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from PySide6.QtCore import QItemSelectionModel, QSortFilterProxyModel, Qt

from console.fleet.errors import (
    AgentUnreachableError,
    FleetStateError,
    ForeignAgentError,
    UnknownAgentError,
)
from console.fleet.fleet import FleetModel
from console.fleet_api.agent_record import (
    AgentRecord,
    AgentSource,
    HubNews,
    Membership,
    Poll,
    Sighting,
    merge_record,
)
from console.qt.fleet_table_model import (
    COLUMNS,
    FILTER_ROLE,
    SORT_ROLE,
    Coalescer,
    FleetTableModel,
    diff_records,
    ranges,
)
from engine.control.client import ControlClient
from engine.control.messages import Assignment
from engine.discovery.mdns import Advertisement, Browser, Peer
from engine.state.legacy import APPROVALS_FILE, REVOKED_FILE
from engine.trust.fleet_ca import FleetAuthority, Role
from tests.support.agent_helpers import console
from tests.support.asyncutil import run, until
from tests.support.console_fleet_helpers import agent, joined_fleet
from tests.support.loopback import free_port

pytestmark = pytest.mark.usefixtures("private_keyring")


# -- pure: merging what the sources said -----------------------------------------------------------

def _sighting(source, at, state="idle", address="10.0.0.5", **kw):
    return Sighting(source, kw.pop("name", "desk"), address, 7210, kw.pop("fleet", "F"), state, at=at, **kw)


def test_the_newest_proven_word_wins_an_mdns_claim_never_moves_a_verified_agent_and_a_failed_poll_keeps_it():
    # The hub heard the agent over mutual TLS; a newer mDNS record (anyone's claim) says it moved
    # and paused: the record stays where the proven source put it.
    sightings = {AgentSource.HUB: _sighting(AgentSource.HUB, 1.0, "idle", "10.0.0.5"),
                 AgentSource.MDNS: _sighting(AgentSource.MDNS, 2.0, "paused", "10.0.0.66")}
    r = merge_record("n1", sightings, own_fleet_id="F", approved=True)
    assert (r.state, r.address, r.verified, r.membership) == ("idle", "10.0.0.5", True, Membership.MEMBER)
    assert r.sources == {AgentSource.MDNS, AgentSource.HUB} and r.reachable is None
    # A probe of the new address, where the agent proved its node id, does move it.
    sightings[AgentSource.PROBE] = _sighting(AgentSource.PROBE, 3.0, "serving", "10.0.0.9")
    r = merge_record("n1", sightings, own_fleet_id="F", approved=True)
    assert (r.state, r.address, r.last_seen) == ("serving", "10.0.0.9", 3.0)
    news = HubNews(4.0, "paused", ("someone is using this PC",))
    r = merge_record("n1", sightings, own_fleet_id="F", approved=True, news=news)
    assert r.paused and r.paused_reasons == ("someone is using this PC",) and r.last_seen == 4.0
    failed = Poll(5.0, error="unreachable")
    r = merge_record("n1", sightings, own_fleet_id="F", approved=True, news=news, poll=failed)
    assert (r.reachable, r.error, r.state, r.last_seen) == (False, "unreachable", "paused", 4.0)
    # Known from mDNS alone: listed with what it claims, but not verified (so not approvable).
    claimed = merge_record("n3", {AgentSource.MDNS: _sighting(AgentSource.MDNS, 1.0)}, own_fleet_id="F",
                           approved=False)
    assert claimed.membership is Membership.MEMBER and not claimed.verified and claimed.state == "unverified"
    other = merge_record("n2", {AgentSource.MDNS: _sighting(AgentSource.MDNS, 1.0, fleet="G")},
                         own_fleet_id="F", approved=False)
    assert other.membership is Membership.OTHER_FLEET and not other.verified
    fresh = merge_record("instance:x", {AgentSource.MDNS: _sighting(AgentSource.MDNS, 1.0, fleet="",
                                                                    instance="x")},
                         own_fleet_id="F", approved=False)
    assert fresh.membership is Membership.NOT_JOINED and fresh.node_id == "" and fresh.key == "instance:x"


def test_a_corrupt_approvals_file_from_before_the_database_is_a_clear_error_and_is_left_in_place(tmp_path):
    creds = FleetAuthority.create("t").issue_credentials("console", role=Role.CONSOLE)
    path = tmp_path / APPROVALS_FILE
    path.write_text("{not json")
    with pytest.raises(FleetStateError) as err:
        FleetModel(tmp_path, creds)
    assert str(path) in str(err.value) and "move it aside" in str(err.value)
    assert path.read_text() == "{not json"
    path.write_text(json.dumps({"format": 1, "agents": {"n1": {"node_id": "n1", "name": 3}}}))
    with pytest.raises(FleetStateError, match=f"{APPROVALS_FILE}.*damaged"):
        FleetModel(tmp_path, creds)


def test_a_damaged_revocation_list_stops_the_console_rather_than_letting_removed_pcs_back(tmp_path):
    creds = FleetAuthority.create("t").issue_credentials("console", role=Role.CONSOLE)
    path = tmp_path / REVOKED_FILE
    for text in ("{not json", json.dumps({"format": 1, "revoked": {"not-a-node-id": {}}})):
        path.write_text(text)
        with pytest.raises(FleetStateError) as err:
            FleetModel(tmp_path, creds)
        assert str(path) in str(err.value) and path.read_text() == text  # left in place


# -- live: real agents, real console, real zeroconf on 127.0.0.1 -----------------------------------

@pytest.mark.slow
def test_mdns_lists_members_and_another_fleets_agent_which_cannot_be_approved(tmp_path):
    changes = []

    async def main():
        async with joined_fleet(tmp_path) as f, console(tmp_path / "other") as other:
            stranger = agent(tmp_path, "gamma")
            await stranger.async_start()
            newcomer = agent(tmp_path, "delta")
            await newcomer.async_start()
            browser = Browser("127.0.0.1", f.fleet.update_peers)
            f.fleet.subscribe(changes.append)
            try:
                await stranger.async_join(other.enrollment, other.token())
                await browser.async_start()
                gamma = stranger.status().node_id
                members = {f.node("alpha"), f.node("beta")}

                def listed():
                    keys = {r.key: r for r in f.fleet.records()}
                    return (members | {gamma} <= set(keys) and keys[gamma].membership is Membership.OTHER_FLEET
                            and all(keys[n].verified for n in members)
                            and any(r.membership is Membership.NOT_JOINED for r in keys.values()))

                # mDNS lists them; the console's probe of each advertised address verifies the members
                await until(listed, "both members (probed), the stranger and the newcomer over mDNS")
                for n in members:
                    r = f.fleet.get(n)
                    assert r.membership is Membership.MEMBER and {AgentSource.MDNS, AgentSource.PROBE} <= r.sources
                    assert r.address == "127.0.0.1" and r.control_port == f.agents[r.name].control_port
                    assert r.state == "idle" and r.devices and r.memory_bytes > 0 and not r.approved
                with pytest.raises(ForeignAgentError, match="another fleet"):
                    f.fleet.approve(gamma)
                unjoined = next(r for r in f.fleet.records() if r.membership is Membership.NOT_JOINED)
                assert unjoined.name == "delta"
                with pytest.raises(ForeignAgentError, match="join token"):
                    f.fleet.approve(unjoined.key)
                with pytest.raises(ForeignAgentError):
                    f.fleet.client(gamma)
                assert f.fleet.approve(f.node("alpha")).approved
                # another fleet's agent is not polled (its TLS refuses this console); members are
                records = {r.key: r for r in await f.fleet.async_refresh()}
                assert records[gamma].reachable is None and records[f.node("beta")].reachable is True
                await newcomer.async_close()  # goodbye packets: it leaves the list
                await until(lambda: not any(r.membership is Membership.NOT_JOINED for r in f.fleet.records()),
                            "the newcomer's goodbye")
                return members
            finally:
                await browser.async_close()
                await stranger.async_close()
                await newcomer.async_close()

    members = run(main())
    assert changes and members <= {r.key for r in changes[-1]}


def test_unicast_registration_and_add_by_address(tmp_path):
    async def main():
        async with joined_fleet(tmp_path, ("alpha",), seeds=True) as f, console(tmp_path / "other") as other:
            alpha = f.node("alpha")
            await until(lambda: alpha in {r.key for r in f.fleet.records()}, "alpha's registration at the hub")
            r = f.fleet.get(alpha)
            assert AgentSource.HUB in r.sources and r.membership is Membership.MEMBER
            assert r.control_port == f.agents["alpha"].control_port and r.address == "127.0.0.1"

            lone = FleetModel(tmp_path / "console2", f.host.credentials)  # no mDNS, no hub
            added = await lone.async_add_address("127.0.0.1", f.agents["alpha"].control_port)
            assert (added.node_id, added.name, added.sources) == (alpha, "alpha", {AgentSource.ADDRESS})
            assert added.membership is Membership.MEMBER and added.state == "idle"
            with pytest.raises(AgentUnreachableError, match="no Deskfleet agent"):
                await lone.async_add_address("127.0.0.1", free_port())
            stranger = agent(tmp_path, "gamma")
            await stranger.async_start()
            try:
                await stranger.async_join(other.enrollment, other.token())
                with pytest.raises(AgentUnreachableError, match="joined this fleet service's fleet"):
                    await lone.async_add_address("127.0.0.1", stranger.control_port)
            finally:
                await stranger.async_close()
            with pytest.raises(UnknownAgentError):
                lone.get("nobody")

    run(main())


@pytest.mark.slow
def test_approvals_persist_across_a_reload_and_remove_forgets(tmp_path):
    async def main():
        async with joined_fleet(tmp_path) as f:
            alpha, beta = f.node("alpha"), f.node("beta")
            for name in ("alpha", "beta"):
                await f.fleet.async_add_address("127.0.0.1", f.agents[name].control_port)
            f.fleet.approve(alpha)
            f.fleet.approve(beta)
            reloaded = FleetModel(tmp_path / "console", f.host.credentials)
            assert {r.key for r in reloaded.approved()} == {alpha, beta}
            saved = reloaded.get(alpha)
            assert saved.sources == {AgentSource.SAVED} and saved.last_seen is None
            assert (saved.name, saved.control_port) == ("alpha", f.agents["alpha"].control_port)
            refreshed = await reloaded.async_refresh_one(alpha)  # the saved address is enough to poll
            assert refreshed.reachable and refreshed.state == "idle" and refreshed.status.node_id == alpha

            reloaded.remove(beta)
            with pytest.raises(UnknownAgentError):
                reloaded.get(beta)
            again = FleetModel(tmp_path / "console", f.host.credentials)
            assert {r.key for r in again.records()} == {alpha}
            assert again.deny == (beta,)  # removed is revoked, across a reload too
            with pytest.raises(UnknownAgentError):
                again.remove(beta)
            with pytest.raises(ForeignAgentError, match="revoked"):  # adding it back by address is refused
                await again.async_add_address("127.0.0.1", f.agents["beta"].control_port)
            # after a restart the saved approval is all that is known of alpha: its own mDNS record
            # heard then does not make it an unverified claim (the admin can still pause or resume it)
            ad = Advertisement(instance="alpha-1", node_id=alpha, fleet_id=f.host.credentials.fleet_id,
                               version="0.1.0", devices=("CPU",), memory_bytes=1 << 30, state="idle",
                               control_port=f.agents["alpha"].control_port, addresses=("127.0.0.1",))
            again.update_peers({"alpha-1": Peer(ad, 1.0)})
            listed = again.get(alpha)
            assert AgentSource.MDNS in listed.sources and listed.verified and again.client(alpha) is not None
            # a push under way when another agent is removed: the removed one is skipped, nothing raises
            push = asyncio.create_task(reloaded.async_push_deny())
            await asyncio.sleep(0)  # its list taken, its sends not started
            reloaded.remove(alpha)
            assert await push == {}

    run(main())


@pytest.mark.slow
def test_pause_is_seen_by_polling_and_by_hub_event_and_a_dead_agent_is_marked(tmp_path, tiny_export):
    export = tiny_export("llama", 1)

    async def main():
        async with joined_fleet(tmp_path, exports={"tiny": export}) as f:
            alpha, beta = f.node("alpha"), f.node("beta")
            for name in ("alpha", "beta"):
                await f.fleet.async_add_address("127.0.0.1", f.agents[name].control_port)
                f.fleet.approve(f.node(name))

            paused = await f.fleet.async_pause(alpha)
            assert paused.paused and paused.paused_reasons == ("paused from the console",)
            assert f.agents["alpha"].status().state == "paused"
            resumed = await f.fleet.async_resume(alpha)
            assert resumed.state == "idle" and not resumed.paused_reasons

            # events reach the hub once the agent has an assignment naming the hub's events URL
            assignment = Assignment.create((export / "manifest.json").read_text(), export_id="tiny", stage=0,
                                           source=f.host.hub.shard_url("tiny"), listen_port=0,
                                           next_hop="127.0.0.1:1", events_url=f.host.hub.events_url)
            await ControlClient(f.host.credentials, "127.0.0.1", f.agents["beta"].control_port).async_assign(assignment)
            await f.agents["beta"].async_set_manual_pause(True)  # the person at the PC, from the tray
            await until(lambda: f.fleet.get(beta).paused, "beta's pause event")
            assert f.fleet.get(beta).paused_reasons == ("paused by the user",)
            await f.agents["beta"].async_set_manual_pause(False)
            await until(lambda: not f.fleet.get(beta).paused, "beta's resume event")

            await f.agents["alpha"].async_close()
            records = {r.key: r for r in await f.fleet.async_refresh()}
            assert records[alpha].reachable is False and "unreachable" in records[alpha].error
            assert records[alpha].approved and records[beta].reachable
            with pytest.raises(AgentUnreachableError, match="did not answer"):
                await f.fleet.async_pause(alpha)

    run(main())


# -- the Fleet page's table model: diffs of snapshots, coalescing (Qt offscreen, synthetic records) ------

def _rec(i: int, **kw) -> AgentRecord:
    fields = dict(node_id=f"n{i:04d}", name=f"pc-{i:04d}", address="10.0.0.1", control_port=7000 + i, state="idle",
                  devices=("CPU",), memory_bytes=8 * 10**9, fleet_id="F", membership=Membership.MEMBER,
                  last_seen=100.0, sources=frozenset({AgentSource.HUB}), approved=True, verified=True)
    fields.update(kw)
    return AgentRecord(**fields)


def test_the_diff_of_two_snapshots_names_removed_changed_and_added_rows_and_ignores_time_passing():
    old = [_rec(i) for i in range(6)]
    new = [_rec(5, last_seen=200.0), _rec(0), _rec(2, state="paused"), _rec(3, approved=False), _rec(9), _rec(7)]
    d = diff_records(old, new)
    # rows 1 and 4 went; after that pc-2 (row 1) and pc-3 (row 2) show something else; pc-5 only
    # moved on in time (last_seen), which the clock redraws; the newcomers go last in snapshot order
    assert d.removed == (1, 4) and d.changed == (1, 2) and [r.name for r in d.added] == ["pc-0009", "pc-0007"]
    assert diff_records(old, list(reversed(old))).empty  # order alone is not news
    assert diff_records([], old).added == tuple(old) and diff_records(old, []).removed == tuple(range(6))
    assert ranges([7, 1, 2, 3, 9, 10]) == [(1, 3), (7, 7), (9, 10)] and ranges([]) == []


def test_the_model_follows_snapshots_by_diff_keeping_row_identity_and_selection(qtbot):
    model = FleetTableModel(clock=lambda: 130.0)
    signals = []
    model.rowsRemoved.connect(lambda _p, a, b: signals.append(("removed", a, b)))
    model.rowsInserted.connect(lambda _p, a, b: signals.append(("inserted", a, b)))
    model.dataChanged.connect(lambda a, b, *_: signals.append(("changed", a.row(), b.row())))
    model.apply([_rec(i) for i in range(1000)])
    assert signals == [("inserted", 0, 999)] and model.rowCount() == 1000
    selection = QItemSelectionModel(model)
    selection.select(model.index(500, 0), QItemSelectionModel.SelectionFlag.Select)
    signals.clear()
    # 10 agents change state, agent 3 is removed, one joins; everyone's last_seen moves on
    snapshot = [_rec(i, last_seen=120.0, state="paused" if i % 100 == 7 else "idle", paused_reasons=())
                for i in range(1000) if i != 3] + [_rec(1000, tags=("floor-2",))]
    model.apply(snapshot)
    changed_rows = sorted(a for kind, a, b in signals if kind == "changed")
    assert signals[0] == ("removed", 3, 3) and signals[-1] == ("inserted", 999, 999)
    assert changed_rows == [i - 1 if i > 3 else i for i in range(7, 1000, 100)]  # the paused ones, one each
    assert model.index(999, 0).data() == "pc-1000" and model.index(999, 2).data() == "floor-2"
    assert model.record(6).state == "paused"
    assert model.index(6, 1).data() == "paused" and model.index(6, 5).data() == "10 s ago"
    assert model.record(0).last_seen == 120.0  # the newest record is kept even where nothing is repainted
    assert [i.row() for i in selection.selectedIndexes()] == [499]  # the same agent, one row up
    assert model.record(499).name == "pc-0500" and model.row_of("n0500") == 499
    model.apply([])
    assert model.rowCount() == 0 and model.row_of("n0500") is None


def test_the_coalescer_applies_the_newest_snapshot_at_most_once_per_interval(qtbot):
    applied = []
    coalescer = Coalescer(applied.append, interval_ms=200)
    coalescer.offer(1)  # after a quiet spell: at once
    for value in range(2, 50):
        coalescer.offer(value)
    assert applied == [1]
    qtbot.waitUntil(lambda: applied == [1, 49], timeout=2000)
    qtbot.wait(300)
    assert applied == [1, 49]  # nothing pending, nothing applied


def test_the_proxy_filters_by_name_state_and_tag_and_sorts_numbers_as_numbers(qtbot):
    page_model = FleetTableModel()
    proxy = QSortFilterProxyModel()
    proxy.setSourceModel(page_model)
    proxy.setSortRole(SORT_ROLE)
    proxy.setFilterRole(FILTER_ROLE)
    proxy.setFilterKeyColumn(0)
    proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
    page_model.apply([_rec(1, memory_bytes=16 * 10**9), _rec(2, memory_bytes=4 * 10**9, state="paused"),
                      _rec(3, memory_bytes=32 * 10**9, reachable=False, tags=("finance", "floor-2"))])
    proxy.sort(COLUMNS.index("Memory"), Qt.SortOrder.AscendingOrder)
    assert [proxy.index(r, 0).data() for r in range(3)] == ["pc-0002", "pc-0001", "pc-0003"]  # 4 < 16 < 32 GB
    proxy.setFilterFixedString("PAUSED")
    assert [proxy.index(r, 0).data() for r in range(proxy.rowCount())] == ["pc-0002"]
    proxy.setFilterFixedString("unreach")
    assert [proxy.index(r, 0).data() for r in range(proxy.rowCount())] == ["pc-0003"]
    proxy.setFilterFixedString("FLOOR-2")
    assert [proxy.index(r, 2).data() for r in range(proxy.rowCount())] == ["finance, floor-2"]


# -- the Fleet page against a real fleet service and real agents (pytest-qt, offscreen) -----------------

@pytest.mark.slow
def test_the_fleet_page_approves_pauses_resumes_and_removes_every_selected_agent(tmp_path, qtbot, private_dirs):
    from tests.console.console_app_helpers import ConsoleDriver, fleet_service, local_agents, running_console

    def wait(condition, timeout: float, what: str) -> None:
        try:
            qtbot.waitUntil(condition, timeout=int(timeout * 1000))
        except AssertionError:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None

    names = tuple(f"{n}-{uuid.uuid4().hex[:4]}" for n in ("ant", "bee", "cat"))
    with (fleet_service(tmp_path / "fleet") as service, running_console(tmp_path / "fleet", wait, service) as window,
          local_agents(tmp_path, names) as (agent_loop, agents)):
        drive, page = ConsoleDriver(window, wait), window.fleet_page
        drive.join(agent_loop, agents)
        drive.wait_rows(names, lambda row: row["State"].startswith("awaiting approval") and row["Approved"] == "no",
                        "the joined agents")
        assert {page.model.record(r).name for r in range(page.model.rowCount())} >= set(names)

        drive.select(names)  # all three: one press approves them all
        assert [r.name for r in page.selected()] == sorted(names) and page.approve_button.isEnabled()
        page.approve_button.click()
        drive.wait_rows(names, lambda row: row["Approved"] == "yes", "the approvals")
        wait(lambda: page.batch.finished, 10, "the approvals' answers")
        assert page.message.text() == "Approved 3 of 3 agent(s)."
        assert {r.name for r in service.service.fleet.records() if r.approved} >= set(names)  # the service's word

        drive.select(names[:2])
        page.pause_button.click()
        drive.wait_rows(names[:2], lambda row: row["State"].startswith("paused"), "the pauses")
        assert [agents[n].status().state for n in names] == ["paused", "paused", "idle"]
        page.filter_edit.setText("PAUSED")  # the filter box: by state (and name, and tag)
        assert sorted(page.proxy.index(r, 0).data() for r in range(page.proxy.rowCount())) == sorted(names[:2])
        assert page.count_label.text().startswith(f"showing 2 of {page.model.rowCount()} agents")
        page.filter_edit.setText(names[2])
        assert [page.proxy.index(r, 0).data() for r in range(page.proxy.rowCount())] == [names[2]]

        def node(name: str) -> str:
            return next(r.node_id for r in drive.bridge.records if r.name == name)

        async def tag() -> None:  # the admin tags one agent in the service (the Tags column, the filter)
            service.service.fleet.set_tags(node(names[2]), ("floor-2",))

        service.loop.run(tag(), 10, "tagging an agent")
        drive.wait_rows(names[2:], lambda row: row["Tags"] == "floor-2", "the tag in the table")
        page.filter_edit.setText("Floor-2")
        assert [page.proxy.index(r, 0).data() for r in range(page.proxy.rowCount())] == [names[2]]
        page.filter_edit.clear()

        drive.select(names)  # resume applies to the two paused ones only, and says so
        assert page.resume_button.isEnabled() and page.pause_button.isEnabled()
        page.resume_button.click()
        drive.wait_rows(names, lambda row: row["State"] == "idle", "the resumes")
        wait(lambda: page.batch.finished, 10, "the resumes' answers")
        assert page.message.text().startswith("Resumed 2 of 2 agent(s). (1 selected agent(s) left out")
        assert [agents[n].status().state for n in names] == ["idle", "idle", "idle"]

        drive.select(names[1:])  # Remove asks first, with the count; Cancel removes nothing
        page.remove_button.click()
        box = page.confirmation
        assert box is not None and box.text() == "Remove 2 agents from the fleet?"
        box.button(box.StandardButton.Cancel).click()
        qtbot.wait(300)
        assert set(names) <= set(drive.fleet_rows()) and page.confirmation is None
        page.remove_button.click()
        page.confirmation.button(page.confirmation.StandardButton.Yes).click()
        wait(lambda: not set(names[1:]) & set(drive.fleet_rows()), 20, "the removed rows to go")
        assert names[0] in drive.fleet_rows() and page.message.text() == "Removed 2 of 2 agent(s)."
        assert not {r.name for r in service.service.fleet.records()} & set(names[1:])
        assert len(service.service.fleet.deny) == 2  # revoked, not just forgotten

        from console.qt.tokens_dialog import QtTokensDialog
        page.tokens_button.click()  # the reusable join tokens, in a dialog of their own
        assert isinstance(page.tokens_dialog, QtTokensDialog) and page.tokens_dialog.isVisible()
        page.tokens_dialog.close()


def test_a_refresh_that_changes_nothing_on_screen_makes_no_qt_call_that_drops_a_reference(qtbot):
    """PySide6 6.12.0 on CPython 3.11 drops a reference to None on every void Qt call and the
    process aborts when they run out: the page's per-refresh path calls Qt only for what changed.
    (On an interpreter where None is immortal the count does not move at all.)"""
    import sys

    from PySide6.QtCore import QObject, Signal

    from console.qt.fleet_page import QtFleetPage

    class Bridge(QObject):  # the signals the page listens to; records come from the test
        records_changed, token_changed, started = Signal(object), Signal(str), Signal()
        records, enrollment = (), ""

        def new_token(self) -> None:
            raise AssertionError("not pressed here")

    page = QtFleetPage(Bridge(), coalesce_ms=0)
    qtbot.addWidget(page)
    snapshots = [tuple(_rec(i, last_seen=float(k)) for i in range(200)) for k in range(60)]
    page._apply(snapshots[0])
    page.select({"n0003", "n0004"})
    before = sys.getrefcount(None)
    for snapshot in snapshots[1:]:
        page._apply(snapshot)
    assert sys.getrefcount(None) - before > -20  # not one (or five) per refresh
    assert page.model.applied == 61 and [r.name for r in page.selected()] == ["pc-0003", "pc-0004"]
