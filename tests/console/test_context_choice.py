"""The Placement's default context: the model's maximum, capped by the agents' memory with the
reason in words (pure: console.fleet_api.context_choice), and the tags rule placement keeps to
(pure: engine.control.tags), and solve_inputs leaving agents out by their tags."""

from __future__ import annotations

import pytest

from console.fleet.placement_inputs import LEFT_OUT, solve_inputs
from console.fleet_api.context_choice import MIN_CONTEXT, ROUND, choose_context
from engine.control.tags import parse_tags, reported_tags, tag_exclusions, tags_from_text
from engine.errors import Exclusion, TagError
from engine.placement.types import PlacementRequest

GB = 10**9


def test_the_model_maximum_when_the_memory_holds_it():
    choice = choose_context(8192, kv_bytes_per_token=2 * 1024 * 22, weight_bytes=1 * GB,
                            free=[("desk-a", 8 * GB), ("desk-b", 6 * GB)])
    assert choice.tokens == 8192 and not choice.capped
    assert choice.reason.startswith("model maximum (8,192 tokens)")
    # (0.8 x 14 GB - 1 GB) / 45,056 B a token, rounded down to 256
    expected = int((0.8 * 14 * GB - GB) // (2 * 1024 * 22)) // ROUND * ROUND
    assert choice.memory_tokens == expected and f"{expected:,}" in choice.reason


def test_capped_by_memory_names_the_agents_and_the_figures():
    kv = 2 * 8 * 128 * 2 * 32  # 8 KV heads of 128, f16, 32 layers: 131,072 B a token
    choice = choose_context(131072, kv_bytes_per_token=kv, weight_bytes=4 * GB,
                            free=[("pc-a", 2 * GB), ("pc-b", 12 * GB)], streams=2)
    room = 0.8 * 14 * GB - 4 * GB
    assert choice.capped and choice.tokens == int(room // (kv * 2)) // ROUND * ROUND < 131072
    assert choice.tokens % ROUND == 0
    assert choice.reason.startswith("capped by memory: 11.2 GB usable (pc-b 9.6 GB, pc-a 1.6 GB)")
    assert "less 4.0 GB of weights" in choice.reason and "each of 2 streams" in choice.reason
    assert "model maximum 131,072" in choice.reason
    # more streams: less context each
    one = choose_context(131072, kv_bytes_per_token=kv, weight_bytes=4 * GB, free=[("pc-a", 2 * GB), ("pc-b", 12 * GB)])
    assert one.tokens >= 2 * choice.tokens - ROUND and "for one stream" not in one.reason


def test_weights_that_do_not_fit_and_no_memory_known():
    tight = choose_context(4096, kv_bytes_per_token=1000, weight_bytes=10 * GB, free=[("pc-a", 4 * GB)])
    assert tight.capped and tight.tokens == 1024 and tight.memory_tokens == 0
    assert "cannot hold the model" in tight.reason and "10.0 GB of weights" in tight.reason
    unknown = choose_context(2048, kv_bytes_per_token=1000, weight_bytes=GB, free=[])
    assert unknown.tokens == 2048 and not unknown.capped and "no agent's free memory" in unknown.reason
    many = choose_context(2048, kv_bytes_per_token=10**9, weight_bytes=0, free=[(f"pc-{i}", GB) for i in range(5)])
    assert "and 2 more" in many.reason and many.memory_tokens < MIN_CONTEXT and many.capped
    with pytest.raises(ValueError):
        choose_context(0, kv_bytes_per_token=1, weight_bytes=0, free=[])


def test_tags_are_checked_and_normalised():
    assert parse_tags(["Floor-2", "finance", "finance", " dept=it "]) == ("dept=it", "finance", "floor-2")
    assert tags_from_text("floor-2, finance  room:4.12") == ("finance", "floor-2", "room:4.12")
    assert tags_from_text("") == ()
    for bad in (["two words"], [""], ["-lead"], ["x" * 33], [3]):
        with pytest.raises(TagError):
            parse_tags(bad)
    with pytest.raises(TagError, match="at most 16"):
        parse_tags([f"t{i}" for i in range(17)])
    with pytest.raises(TagError, match="list of tags"):
        parse_tags("floor-2")
    assert reported_tags(["ok", "not ok", 7]) == ("ok",) and reported_tags("nope") == ()


def test_include_and_exclude_tags():
    tags = {"a": ("floor-2", "finance"), "b": ("floor-3",), "c": ()}
    assert tag_exclusions(tags) == {}
    assert tag_exclusions(tags, include=["floor-2"]) == {"b": "not tagged floor-2", "c": "not tagged floor-2"}
    assert tag_exclusions(tags, include=["floor-2", "floor-3"]) == {"c": "not tagged floor-2 or floor-3"}
    assert tag_exclusions(tags, exclude=["Finance"]) == {"a": "tagged finance (excluded)"}
    # exclusion wins over inclusion
    assert tag_exclusions(tags, include=["finance"], exclude=["finance"])["a"] == "tagged finance (excluded)"
    with pytest.raises(TagError, match="include_tags"):
        tag_exclusions(tags, include=["no spaces"])


def _inputs():
    """Two PCs, each able to hold the whole four-layer model."""
    from console.fleet_api.link_report import LinkReport
    from console.fleet_api.placement import PlacementInputs
    from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo

    model = ModelProfile(layer_bytes=(600,) * 4, embed_bytes=100, head_bytes=150, head_ms=0.3)
    devices = tuple(DeviceProfile(f"{pc}/CPU", pc, "CPU", ms, 0.2, 20000) for pc, ms in (("a", 1.0), ("b", 1.5)))
    links = LinkReport(Links(pc_ms={("a", "b"): 0.25}, coordinator_ms={"a": 0.1, "b": 0.4}), {}, {})
    pcs = (PcInfo("a", 20000, True), PcInfo("b", 20000, True), PcInfo("c", 20000, False))
    return PlacementInputs(model, pcs, devices, links, (), {"a": "desk-a", "b": "desk-b", "c": "desk-c"}, {})


def test_solve_inputs_leaves_tagged_agents_out_with_the_reason():
    inputs = _inputs()
    assert {s.pc_id for s in solve_inputs(inputs, PlacementRequest()).stages} == {"a"}  # the faster one
    plan = solve_inputs(inputs, PlacementRequest(), tagged_out={"a": "not tagged floor-2", "c": "not tagged floor-2"})
    assert {s.pc_id for s in plan.stages} == {"b"}
    assert Exclusion("a", "not tagged floor-2") in plan.excluded
    assert Exclusion("c", "not approved") in plan.excluded  # its tags are not why it takes no stage
    # the admin's own choice names itself
    both = solve_inputs(inputs, PlacementRequest(), leave_out={"a"}, tagged_out={"a": "tagged x (excluded)"})
    assert Exclusion("a", LEFT_OUT) in both.excluded
