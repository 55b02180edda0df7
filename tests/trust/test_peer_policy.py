"""The data-plane peer policy as pure decisions: who may dial, who must answer, what updates parse."""

from __future__ import annotations

import pytest

from engine.trust.peer_policy import PeerPolicy, PeerPolicyError, parse_policy_update

A, B, C = ("a" * 64), ("b" * 64), ("c" * 64)


def test_only_the_expected_upstream_is_admitted_and_the_deny_set_always_wins():
    policy = PeerPolicy.of([A, B], C, deny=[B])
    assert policy.refuse_upstream(A) is None
    assert "revoked" in policy.refuse_upstream(B)  # expected and denied: denied
    assert "not the upstream peer" in policy.refuse_upstream(C)
    assert "no certificate" in policy.refuse_upstream(None)
    assert policy.refuse_next(C) is None
    assert "not the one the placement names" in policy.refuse_next(A)
    assert "revoked" in PeerPolicy.of([], B, deny=[B]).refuse_next(B)


def test_an_empty_policy_refuses_everyone_it_never_means_any_member():
    empty = PeerPolicy()
    for node in (A, B, None):
        assert empty.refuse_upstream(node) is not None
        assert empty.refuse_next(node) is not None
    assert "no upstream peer is expected" in empty.refuse_upstream(A)


def test_refusals_name_only_the_peer_never_the_expected_ids():
    policy = PeerPolicy.of([A], C)
    assert A not in policy.refuse_upstream(B) and A[:12] not in policy.refuse_upstream(B)
    assert B[:12] in policy.refuse_upstream(B)


def test_parse_policy_update_reads_the_documented_keys_and_replaces_whole():
    policy = parse_policy_update({"expect_upstream": [A.upper()], "expect_next": B, "deny": [C]})
    assert policy == PeerPolicy(frozenset({A}), B, frozenset({C}))
    assert parse_policy_update({}) == PeerPolicy()  # absent keys: empty, not "keep the old ones"
    assert parse_policy_update({"expect_next": None}).next is None
    with_creds = {"ca_pem": "x", "cert_pem": "y", "key_pem": "z", "expect_upstream": [A]}
    assert parse_policy_update(with_creds, allow_credentials=True).upstream == {A}


@pytest.mark.parametrize("blob, says", [
    ({"expect_upstrem": [A]}, "unknown key"),
    ({"ca_pem": "x"}, "unknown key"),  # credentials only on the first line
    ({"expect_upstream": A}, "must be a list"),
    ({"expect_upstream": [A, 3]}, "must be a list"),
    ({"expect_upstream": ["ab" * 31]}, "is not a node id"),
    ({"expect_next": ["x"]}, "expect_next must be"),
    ({"deny": ["z" * 64]}, "is not a node id"),
    ({"deny": [A] * 2000}, "at most"),
    ([A], "must be a JSON object"),
])
def test_parse_policy_update_refuses_what_it_does_not_understand(blob, says):
    with pytest.raises(PeerPolicyError, match=says):
        parse_policy_update(blob)
