"""The router's pure policy: block hashes, the per-ring prefix memory, and the ranking of rings."""

from __future__ import annotations

import pytest

from engine.generation.ring_report import RingStatus
from engine.generation.routing_policy import PrefixMemory, RingView, RoutingPolicy, block_hashes, rank_rings

OK, RECOVERING, DOWN = RingStatus.OK, RingStatus.RECOVERING, RingStatus.DOWN


def test_block_hashes_are_chained_and_cover_full_blocks_only():
    a = block_hashes(range(10), 4)
    assert len(a) == 2  # 10 tokens: two full blocks of 4, the last 2 tokens are no block
    assert block_hashes(range(12), 4)[:2] == a  # a longer sequence extends the chain
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # block 1 depends on block 0
    assert block_hashes(range(3), 4) == ()
    assert block_hashes(range(10), 4, "") == a and not set(block_hashes(range(10), 4, "key:b")) & set(a)
    with pytest.raises(ValueError):
        block_hashes(range(3), 0)


def test_prefix_memory_matches_a_chain_and_forgets_the_least_recently_used():
    memory = PrefixMemory(capacity=4)
    turn1 = block_hashes(range(8), 2)  # 4 blocks
    memory.remember(turn1)
    assert memory.matched(block_hashes(range(12), 2)) == 4  # a second turn finds the first's blocks
    assert memory.matched(block_hashes([0, 1, 9, 9, 4, 5], 2)) == 1  # a miss ends the chain
    memory.remember(block_hashes([7, 7, 7, 7], 2))  # 2 new hashes: the 2 oldest go
    assert len(memory) == 4
    assert memory.matched(turn1) == 1  # block 0 was used by the last match, so it stayed
    with pytest.raises(ValueError):
        PrefixMemory(0)


def test_least_loaded_then_fewest_served_then_order():
    views = [RingView("a", OK, load=3), RingView("b", OK, load=1), RingView("c", OK, load=1, served=5)]
    assert rank_rings(views, 0) == ("b", "c", "a")
    assert rank_rings([RingView("a", OK, 0), RingView("b", OK, 0)], 0) == ("a", "b")


def test_recovering_rings_only_when_none_is_ok_and_down_rings_last():
    views = [RingView("down", DOWN, 0), RingView("rec", RECOVERING, 0), RingView("busy", OK, 9)]
    assert rank_rings(views, 0) == ("busy", "rec", "down")
    assert rank_rings([RingView("down", DOWN, 0), RingView("rec", RECOVERING, 5)], 0) == ("rec", "down")


def test_a_conversation_sticks_to_the_ring_holding_its_prefix():
    views = [RingView("a", OK, load=0), RingView("b", OK, load=2, matched=3)]
    assert rank_rings(views, prompt_blocks=4) == ("b", "a")
    # the longest match wins among rings holding part of it
    views = [RingView("a", OK, 1, matched=3), RingView("b", OK, 1, matched=4)]
    assert rank_rings(views, 4) == ("b", "a")


def test_a_short_shared_prefix_does_not_pin_new_conversations():
    """A system prompt that fills 1 of 4 blocks is shared by every conversation: least loaded wins."""
    views = [RingView("a", OK, load=2, matched=1), RingView("b", OK, load=0)]
    assert rank_rings(views, prompt_blocks=4) == ("b", "a")
    assert rank_rings(views, prompt_blocks=2) == ("b", "a")  # exactly half is not more than half


def test_a_prefix_does_not_pin_a_request_to_a_much_busier_ring():
    policy = RoutingPolicy(balance_slack=2)
    assert rank_rings([RingView("a", OK, 0), RingView("b", OK, 2, matched=4)], 4, policy) == ("b", "a")
    assert rank_rings([RingView("a", OK, 0), RingView("b", OK, 3, matched=4)], 4, policy) == ("a", "b")


def test_a_prefix_on_a_recovering_ring_does_not_beat_an_ok_ring():
    views = [RingView("a", OK, 4), RingView("b", RECOVERING, 0, matched=8)]
    assert rank_rings(views, 8) == ("a", "b")


def test_policy_knobs_are_checked():
    with pytest.raises(ValueError):
        RoutingPolicy(min_match_ratio=1.0)
    with pytest.raises(ValueError):
        RoutingPolicy(balance_slack=-1)
