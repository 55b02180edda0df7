"""The served rings (a table of the state database): what the fleet service re-forms after a restart
survives a round trip, a damaged row or an old damaged served-rings.json is a clear error left in
place (never an empty fleet), and ring ids are checked."""

from __future__ import annotations

import json

import pytest

from console.fleet.errors import FleetStateError
from console.fleet.served_rings import RingIdError, ServedRing, ServedRings, next_ring_id
from console.fleet_api.exports import ExportSpec
from engine.placement.types import Plan, PlannedStage
from engine.state.db import StateDB
from engine.state.legacy import SERVED_FILE
from tests.support.state_helpers import damage_document


def _plan(*pcs: str) -> Plan:
    stages = tuple(PlannedStage(f"{pc}/CPU", pc, 2 * i, 2 * i + 1, 1.5, 1 << 20) for i, pc in enumerate(pcs))
    return Plan(stages=stages, hop_ms=(0.5,) * (len(stages) + 1), per_token_ms=3.0, tok_s=333.3, bottleneck_ms=1.5,
                n_streams=2, cycle_ms=1.5, aggregate_tok_s=666.6, objective="throughput", optimal=True)


def test_rings_and_api_port_survive_a_restart(tmp_path):
    book = ServedRings(tmp_path)
    assert book.state.rings == () and book.state.api_port == 0
    one = ServedRing("r1", "tiny", _plan("pc-a", "pc-b"), ExportSpec(weights="int8"), standby=("pc-c",))
    book.put(one)
    book.put(ServedRing("r2", "tiny", _plan("pc-c")))
    book.set_api_port(8123)
    book.put(ServedRing("r1", "tiny", one.plan, one.spec, export_id="tiny-2", standby=one.standby,
                        return_port=40001, created=one.created))

    StateDB.forget(tmp_path)  # a restart: read back from the file
    again = ServedRings(tmp_path).state
    assert again.api_port == 8123
    assert [r.ring for r in again.rings] == ["r1", "r2"]  # replaced in place
    r1 = again.ring("r1")
    assert r1 is not None and r1.export_id == "tiny-2" and r1.return_port == 40001
    assert r1.plan == one.plan and r1.spec.weights == "int8" and r1.standby == ("pc-c",)
    assert r1.node_ids == ("pc-a", "pc-b")
    assert again.ring("r2").standby is None

    book.remove("r2")
    assert [r.ring for r in ServedRings(tmp_path).state.rings] == ["r1"]
    damage_document(tmp_path, "served_rings")
    with pytest.raises(FleetStateError, match="is damaged"):
        ServedRings(tmp_path)


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 99, "rings": []}),
                                  json.dumps({"format": 1, "rings": [{"ring": "r1"}]})])
def test_a_damaged_file_from_before_the_database_is_a_clear_error_and_is_left_in_place(tmp_path, text):
    (tmp_path / SERVED_FILE).write_text(text)
    with pytest.raises(FleetStateError, match="served rings|served-rings") as err:
        ServedRings(tmp_path)
    assert str(tmp_path / SERVED_FILE) in str(err.value) and "move it aside" in str(err.value)
    assert (tmp_path / SERVED_FILE).read_text() == text


@pytest.mark.parametrize("ring", [{"ring": "r1", "model": "m", "plan": {}},
                                  {"ring": "bad id!", "model": "m", "plan": {"stages": []}}])
def test_a_damaged_ring_imported_from_before_the_database_is_named_not_dropped(tmp_path, ring):
    (tmp_path / SERVED_FILE).write_text(json.dumps({"format": 1, "rings": [ring]}))
    with pytest.raises(FleetStateError, match="served rings in .* are damaged"):
        ServedRings(tmp_path)


def test_ring_ids():
    assert next_ring_id([]) == "r1"
    assert next_ring_id(["r1", "r3"]) == "r2"
    for bad in ("", "-x", "a b", "x" * 33, "../r"):
        with pytest.raises(RingIdError):
            ServedRing(bad, "m", _plan("pc"))
    assert ServedRing("replica.2_b-1", "m", _plan("pc")).ring == "replica.2_b-1"
