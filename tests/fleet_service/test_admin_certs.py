"""Admin certificates recorded, listed and revoked (issue 29, M7), live on a real service's admin HTTPS.

The attacker holds a lost laptop's admin folder. After the revocation (from a shell, on the state
dir's records, or by another admin over the API) the certificate is refused on a connection it kept
alive (403 on its next request) and at the handshake of every new one. A certificate issued before
records existed is recorded the first time it is used, so it too can be listed and revoked. No admin
certificate lives longer than MAX_ADMIN_DAYS.
"""

from __future__ import annotations

import ssl

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from console.fleet.admin_certs import AdminCertBook, AdminCertError
from engine.errors import CredentialsError
from engine.state.db import StateDB
from engine.trust.fleet_ca import MAX_ADMIN_DAYS, peer_node_id
from tests.fleet_service.admin import Admin

pytestmark = pytest.mark.usefixtures("private_keyring")


def _der(creds) -> bytes:
    return x509.load_pem_x509_certificate(creds.cert_pem).public_bytes(Encoding.DER)


async def _refused_at_handshake(url: str, ctx: ssl.SSLContext) -> None:
    async with Admin.tls(url, ctx) as client:
        with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
            status, body = await client.call("GET", "/service", timeout=10)
            pytest.fail(f"a revoked admin certificate was let in: {status} {body}")


def test_a_revoked_admin_certificate_is_refused_on_its_open_connection_and_at_the_handshake(shared_service):
    service = shared_service.service
    state_dir = service.settings.state_dir
    authority = service.host.authority
    book = AdminCertBook(state_dir)

    async def main():
        url = service.admin_url
        alice = authority.issue_admin("alice")
        book.record(_der(alice))  # what `deskfleet fleet admin-cert alice --out DIR` does
        legacy = authority.issue_admin("bob")  # issued before records existed: not recorded
        async with Admin.tls(url, alice.client_context()) as lost_laptop, \
                Admin.tls(url, legacy.client_context()) as bob, Admin.unix(state_dir / "admin.sock") as local:
            assert (await lost_laptop.ok("GET", "/service"))["fleet_id"] == service.fleet.fleet_id
            assert (await bob.ok("GET", "/service"))["fleet_id"] == service.fleet.fleet_id  # let in, and recorded
            rows = {r["name"]: r for r in (await local.ok("GET", "/admin-certs"))["admin_certs"]}
            assert rows["alice"]["fingerprint"] == peer_node_id(_der(alice)) and rows["alice"]["state"] == "active"
            assert rows["bob"]["source"] == "first seen" and rows["bob"]["fingerprint"] == peer_node_id(_der(legacy))
            assert rows["alice"]["not_after"] == alice.not_after.isoformat(timespec="seconds")

            # the admin revokes alice from a shell (`deskfleet fleet admin-cert --revoke alice`): the file only
            revoked = AdminCertBook(state_dir).revoke("alice")
            assert revoked["revoked_at"] and revoked["fingerprint"] == rows["alice"]["fingerprint"]
            status, body = await lost_laptop.call("GET", "/tokens")  # the connection it kept alive
            assert status == 403 and body["error"]["code"] == "revoked" and "alice" in body["error"]["message"]
            await _refused_at_handshake(url, alice.client_context())

            # bob revokes himself over the API by fingerprint start, from another admin's seat
            status, body = await local.call("POST", f"/admin-certs/{rows['bob']['fingerprint'][:12]}/revoke")
            assert status == 200 and body["admin_cert"]["name"] == "bob"
            status, body = await bob.call("GET", "/service")
            assert status == 403
            await _refused_at_handshake(url, legacy.client_context())
            status, body = await local.call("POST", "/admin-certs/nobody/revoke")
            assert status == 404 and "admin-cert --list" in body["error"]["message"]
            states = {r["name"]: r["state"] for r in (await local.ok("GET", "/admin-certs"))["admin_certs"]}
            assert states == {"alice": "revoked", "bob": "revoked"}

            carol = authority.issue_admin("carol")  # the others still work
            book.record(_der(carol))
            async with Admin.tls(url, carol.client_context()) as fresh:
                assert (await fresh.ok("GET", "/service"))["fleet_id"] == service.fleet.fleet_id

    shared_service.run(main(), 120)


def test_admin_certificates_live_at_most_max_admin_days_and_a_damaged_list_fails_closed(tmp_path):
    from engine.trust.fleet_ca import FleetAuthority

    authority = FleetAuthority.create("t")
    with pytest.raises(CredentialsError, match=f"1 to {MAX_ADMIN_DAYS} days, not 3650"):
        authority.issue_admin("alice", days=3650)
    assert authority.issue_admin("alice", days=MAX_ADMIN_DAYS).role is not None
    book = AdminCertBook(tmp_path)
    der = _der(authority.issue_admin("alice"))
    book.record(der)
    with pytest.raises(AdminCertError, match="no recorded admin certificate"):
        book.revoke("mallory")
    path = book.path
    StateDB.forget(tmp_path)  # the service restarts on a damaged database
    path.write_bytes(b"not a database" * 400)
    assert "cannot be read" in book.refusal(der)  # fail closed: nobody in until it is restored
