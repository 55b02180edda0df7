"""Ring members get a key of their own, never the console's unlimited one (issue 29, M9).

Older versions put the console key (no limits, audited as the admin's chat) in every assignment, so
any member PC could use the API without limits. Now an assignment carries the member's own key
(limited, named and revoked with it); the console key every older member held is rotated once, at
the first start of this version; assignments of the old shape still parse on an agent. The ring's
real API serving a member key is tests/console/test_console_distribution.py (slow)."""

from __future__ import annotations

import pytest

from engine.control.fleet_services import (
    API_KEY_SECRET,
    CONSOLE_KEY_MEMBER_SAFE,
    MEMBER_KEY_RPM,
    MEMBER_KEY_TPM,
    fleet_host,
)
from engine.control.messages import Assignment
from engine.trust.key_book import KeyBook, new_secret
from engine.trust.keystore import ConsoleSecrets
from tests.support.asyncutil import run

pytestmark = pytest.mark.usefixtures("private_keyring")

NODE = "ab" * 32


def test_an_older_fleets_console_key_is_rotated_once_and_members_get_limited_keys_of_their_own(tmp_path):
    state = tmp_path / "console"
    state.mkdir(mode=0o700)
    leaked = new_secret()  # the key an older version sent to every member
    ConsoleSecrets(state).put(API_KEY_SECRET, leaked)

    async def main():
        async with fleet_host(state) as host:
            assert host.api_key != leaked and (state / CONSOLE_KEY_MEMBER_SAFE).exists()
            book = KeyBook(state)
            assert book.identify(leaked) is None and book.identify(host.api_key).name == "console"
            mine = host.member_key(NODE)
            assert mine not in (host.api_key, leaked) and host.member_key(NODE) == mine  # stable in a run
            held = book.identify(mine)
            assert (held.node_id, held.rpm, held.tpm) == (NODE, MEMBER_KEY_RPM, MEMBER_KEY_TPM)
            assert held.name.startswith("member-") and host.member_key(None) is None
            assert host.revoke_member_keys(NODE) and book.identify(mine) is None  # removed with the member
            assert host.member_key(NODE) != mine
            return host.api_key

    rotated = run(main(), 60)

    async def again():
        async with fleet_host(state) as host:
            return host.api_key

    assert run(again(), 60) == rotated  # once: a restart keeps the rotated key


def test_a_new_fleets_key_is_not_rotated_and_an_old_shape_assignment_still_parses(tmp_path, tiny_export):
    async def main():
        async with fleet_host(tmp_path / "console") as host:
            return host.api_key

    first = run(main(), 60)
    assert run(main(), 60) == first
    manifest_json = (tiny_export("llama", 2) / "manifest.json").read_text()
    shape = Assignment.create(manifest_json, export_id="e", stage=0, source="https://127.0.0.1:1/shards/e/",
                              listen_port=0, next_hop="127.0.0.1:1", api_key=first).to_dict()
    assert Assignment.from_dict(shape).api_key == first  # an older console's assignment: the agent takes it
    assert Assignment.from_dict({**shape, "api_key": None}).api_key is None
