"""The fleet CA, credentials, join tokens and the keystore; mutual TLS on real loopback sockets."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import re
import ssl
import stat
import sys
import tempfile

import aiohttp
import keyring
import keyring.backends.fail
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from engine.envvars import KEYRING_DIR
from engine.errors import (
    CertificateRequestError,
    CredentialsError,
    JoinRefused,
    JoinTokenError,
    KeyStoreError,
    TokenBookError,
)
from engine.state.db import DB_FILE, StateDB
from engine.trust.fleet_ca import (
    Credentials,
    FleetAuthority,
    Role,
    check_request,
    make_key_and_csr,
    peer_node_id,
    sanitize_name,
)
from engine.trust.join_token import JoinToken, TokenBook, parse_token
from engine.trust.keystore import FileKeyring, KeyStore, default_backend
from tests.support.asyncutil import run


@pytest.fixture(scope="module")
def fleet():
    return FleetAuthority.create("Acme")


@pytest.fixture(scope="module")
def other_fleet():
    return FleetAuthority.create("Elsewhere")


def der(cert_pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)


# -- certificates ------------------------------------------------------------------------------

def test_node_id_is_the_certificate_fingerprint_and_role_is_recorded(fleet):
    creds = fleet.issue_credentials("pc-7", role=Role.AGENT)
    assert creds.node_id == hashlib.sha256(der(creds.cert_pem)).hexdigest() == peer_node_id(der(creds.cert_pem))
    assert creds.fleet_id == hashlib.sha256(der(fleet.ca_pem)).hexdigest()[:16] == fleet.fleet_id
    assert creds.role is Role.AGENT and creds.name == "pc-7"
    days = (creds.not_after - datetime.datetime.now(datetime.UTC)).days
    assert 363 <= days <= 365
    assert "key_pem" not in repr(creds)
    cert = creds.certificate
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {o._name for o in eku} == {"serverAuth", "clientAuth"}


def test_ca_is_a_path_length_zero_ca_and_round_trips_through_pem(fleet, other_fleet):
    ca = x509.load_pem_x509_certificate(fleet.ca_pem)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey) and ca.public_key().curve.name == "secp256r1"
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days >= 3650
    again = FleetAuthority.from_pem(fleet.ca_pem, fleet.key_pem)
    assert again.fingerprint == fleet.fingerprint
    with pytest.raises(CredentialsError, match="does not belong"):
        FleetAuthority.from_pem(fleet.ca_pem, other_fleet.key_pem)
    leaf = fleet.issue_credentials("x", role=Role.CONSOLE)
    with pytest.raises(CredentialsError, match="not a CA"):
        FleetAuthority.from_pem(leaf.cert_pem, leaf.key_pem)


def test_credentials_refuse_a_foreign_key_or_a_foreign_ca(fleet, other_fleet):
    mine = fleet.issue_credentials("a", role=Role.CONSOLE)
    theirs = other_fleet.issue_credentials("b", role=Role.CONSOLE)
    with pytest.raises(CredentialsError, match="does not belong"):
        Credentials(mine.ca_pem, mine.cert_pem, theirs.key_pem)
    with pytest.raises(CredentialsError, match="not issued by the stored fleet CA"):
        Credentials(mine.ca_pem, theirs.cert_pem, theirs.key_pem)
    with pytest.raises(CredentialsError, match="not a PEM certificate"):
        Credentials(b"garbage", mine.cert_pem, mine.key_pem)


def _csr(key, name="pc", extensions=()):
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
    for ext in extensions:
        builder = builder.add_extension(ext, critical=True)
    return builder.sign(key, None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()).public_bytes(
        serialization.Encoding.PEM)


def test_bad_certificate_requests_are_refused(fleet):
    _, good = make_key_and_csr("pc")
    tampered = bytearray(x509.load_pem_x509_csr(good).public_bytes(serialization.Encoding.DER))
    tampered[-5] ^= 0xFF  # a byte inside the signature
    tampered_pem = (b"-----BEGIN CERTIFICATE REQUEST-----\n" + base64.encodebytes(bytes(tampered))
                    + b"-----END CERTIFICATE REQUEST-----\n")
    cases = {
        b"not a csr": "not a readable PEM CSR",
        tampered_pem: "signature does not verify",
        _csr(rsa.generate_private_key(65537, 1024)): "1024 bits",
        _csr(ec.generate_private_key(ec.SECP224R1())): "curve secp224r1",
        _csr(ed25519.Ed25519PrivateKey.generate()): "only EC and RSA",
        b"x" * 20000: "at most",
    }
    for pem, why in cases.items():
        with pytest.raises(CertificateRequestError, match=why):
            fleet.sign_request(pem, role=Role.AGENT)
    assert check_request(good).is_signature_valid


def test_a_request_cannot_make_itself_a_ca_and_names_are_sanitised(fleet):
    key = ec.generate_private_key(ec.SECP256R1())
    pem = _csr(key, "evil\nname/../<x>", [x509.BasicConstraints(ca=True, path_length=None)])
    cert = x509.load_pem_x509_certificate(fleet.sign_request(pem, role=Role.AGENT))
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "evil name-..--x-"
    long_name = fleet.sign_request(pem, role=Role.AGENT, name="Büro " * 30)
    cn = x509.load_pem_x509_certificate(long_name).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn.startswith("B-ro B-ro") and len(cn.encode()) <= 64
    assert sanitize_name("  ") == "unnamed" and sanitize_name("Büro PC 3") == "B-ro PC 3"


@pytest.mark.parametrize("name, shown", [
    ("desk-1", "desk-1"), ("Desk_2.local", "Desk_2.local"), ("  two   words ", "two words"),
    ("d\u0435sk-1", "d-sk-1"),  # a Cyrillic 'е' would show as "desk-1"
    ("desk\u200b-1", "desk--1"),  # a zero-width space
    ("ｄｅｓｋ", "----"),  # fullwidth letters
    ("desk\u202e1-", "desk-1-"),  # a right-to-left override
    ("a/b\\c:d*?<>|\"", "a-b-c-d------"), ("tab\there\nnewline", "tab here newline"),
    ("x" * 100, "x" * 64), ("\u00e9" * 3, "---"),
])
def test_pc_names_keep_only_a_safe_ascii_alphabet(name, shown):
    assert sanitize_name(name) == shown
    assert re.fullmatch(r"[A-Za-z0-9 ._-]{1,64}", sanitize_name(name))


def test_look_alike_names_do_not_collide_with_the_real_one(fleet):
    _, csr = make_key_and_csr("d\u0435sk-1")  # the CSR carries the look-alike; the CA keeps it ASCII
    cert = x509.load_pem_x509_certificate(fleet.sign_request(csr, role=Role.AGENT))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "d-sk-1" != "desk-1"


def test_validity_is_cut_at_the_ca_expiry():
    short = FleetAuthority.create("short", days=10)
    creds = short.issue_credentials("pc", role=Role.CONSOLE, days=365)
    assert creds.not_after <= x509.load_pem_x509_certificate(short.ca_pem).not_valid_after_utc


# -- mutual TLS ---------------------------------------------------------------------------------

async def _serve(ctx):
    """An aiohttp HTTPS server that records the node id of every caller it gets to answer."""
    seen: list[str] = []

    async def hello(request):
        seen.append(peer_node_id(request.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)))
        return web.Response(text="member")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
    return runner, runner.addresses[0][1], seen


async def _call(port, ctx):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.get(f"https://127.0.0.1:{port}/", ssl=ctx, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return await r.text()


def _bare_client(ca_pem):
    """A client that trusts the fleet CA but has no certificate of its own."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=ca_pem.decode())
    return ctx


def test_mutual_tls_admits_members_and_refuses_everyone_else(fleet, other_fleet):
    server = fleet.issue_credentials("console", role=Role.CONSOLE)
    member = fleet.issue_credentials("pc-1", role=Role.AGENT)
    stranger = other_fleet.issue_credentials("pc-x", role=Role.AGENT)
    key_pem, csr_pem = make_key_and_csr("pc-old")
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=400)
    expired = Credentials(fleet.ca_pem, fleet.sign_request(csr_pem, role=Role.AGENT, days=30, now=long_ago), key_pem)
    assert expired.not_after < datetime.datetime.now(datetime.UTC)
    # A member of another fleet: trusts only its own CA, so it must refuse our server.
    naive = Credentials(stranger.ca_pem, stranger.cert_pem, stranger.key_pem).client_context()

    async def scenario():
        runner, port, seen = await _serve(server.server_context())
        try:
            assert await _call(port, member.client_context()) == "member"
            assert seen == [member.node_id]
            for name, ctx in (("no certificate", _bare_client(fleet.ca_pem)),
                              ("another fleet's certificate", _mixed(fleet.ca_pem, stranger)),
                              ("an expired certificate", expired.client_context()),
                              ("a client that trusts another CA", naive)):
                with pytest.raises(aiohttp.ClientError):
                    await _call(port, ctx)
                assert seen == [member.node_id], f"{name} was let in"
        finally:
            await runner.cleanup()
        # A server of another fleet that would admit anyone: only the member's own check stops it.
        runner, port, seen = await _serve(stranger.server_context(verify_clients=False))
        try:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await _call(port, member.client_context())
            assert seen == []
        finally:
            await runner.cleanup()

    run(scenario(), 60)


def _mixed(ca_pem, creds):
    """A client that trusts our fleet CA but presents a certificate another CA signed."""
    ctx = _bare_client(ca_pem)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chain.pem")
        with open(path, "wb") as f:
            f.write(creds.cert_pem + creds.key_pem)
        ctx.load_cert_chain(path)
    return ctx


def test_contexts_leave_no_key_on_disk(fleet, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    creds = fleet.issue_credentials("pc", role=Role.CONSOLE)
    creds.server_context()
    creds.client_context()
    assert list(tmp_path.iterdir()) == []


# -- join tokens ----------------------------------------------------------------------------------

def test_tokens_round_trip_and_typos_are_caught(fleet):
    token = JoinToken.new(fleet.fingerprint)
    text = token.text
    assert text.startswith("DFJ1-" + fleet.fingerprint[:32])
    assert parse_token(f"  {text.lower()[:20]}\n{text.lower()[20:]} ") == token
    assert token.pins(fleet.fingerprint)
    i = text.rindex("-") - 3  # a character inside the secret
    typo = text[:i] + ("A" if text[i] != "A" else "B") + text[i + 1:]
    with pytest.raises(JoinTokenError, match="typo"):
        parse_token(typo)
    for bad, why in (("", "not a Deskfleet join token"), ("K10N-abc", "not a Deskfleet join token"),
                     (text.replace("DFJ1", "DFJ2"), "not a Deskfleet join token"),
                     (text[:-1], "typo"), (text.replace(fleet.fingerprint[:32], "z" * 32), "hex digits"),
                     ("DFJ1-" + "a" * 32 + "-" + "1" * 26 + "-AAAA", "A-Z, 2-7")):
        with pytest.raises(JoinTokenError, match=why):
            parse_token(bad)


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


def test_token_book_refuses_replayed_expired_unknown_malformed_and_foreign_tokens(fleet, other_fleet, tmp_path):
    clock = Clock()
    book = TokenBook(tmp_path / "tokens.json", fleet.fingerprint, clock=clock)
    first, second = book.issue(), book.issue(ttl_s=60)
    assert book.outstanding() == 2
    book.redeem(first)
    refusals = {
        first: "used",
        JoinToken.new(fleet.fingerprint).text: "unknown",
        "DFJ1-nonsense": "malformed",
        JoinToken.new(other_fleet.fingerprint).text: "other_fleet",
    }
    clock.now += 61
    refusals[second] = "expired"
    for token, reason in refusals.items():
        with pytest.raises(JoinRefused) as info:
            book.redeem(token)
        assert info.value.reason == reason
        assert "ask the admin" in str(info.value) or "copy it again" in str(info.value) \
            or "console address" in str(info.value)
    assert book.outstanding() == 0


def test_token_book_survives_reload_and_stores_no_secret(fleet, tmp_path):
    path = tmp_path / "state" / "tokens.json"
    token = TokenBook(path, fleet.fingerprint).issue()
    db_file = path.parent / DB_FILE
    stored = b"".join(p.read_bytes() for p in path.parent.glob(f"{DB_FILE}*"))  # the database and its WAL
    assert parse_token(token).secret.hex().encode() not in stored and token.split("-")[2].encode() not in stored
    if sys.platform != "win32":
        assert stat.S_IMODE(db_file.stat().st_mode) == 0o600
    StateDB.forget(path.parent)  # as after a console restart
    TokenBook(path, fleet.fingerprint).redeem(token)
    with pytest.raises(JoinRefused, match="already used"):
        TokenBook(path, fleet.fingerprint).redeem(token)


def test_corrupt_token_book_is_an_error_not_a_silent_reset(fleet, tmp_path):
    path = tmp_path / "tokens.json"
    book = TokenBook(path, fleet.fingerprint)
    token = book.issue()
    StateDB.forget(tmp_path)
    db_file = tmp_path / DB_FILE
    damage = db_file.read_bytes()[:100] + b"\x00\xff" * 3000
    db_file.write_bytes(damage)
    with pytest.raises(TokenBookError, match="damaged.*restore"):
        book.redeem(token)
    with pytest.raises(TokenBookError):
        book.issue()
    assert db_file.read_bytes() == damage  # left for a person to look at


# -- keystore -------------------------------------------------------------------------------------

def test_keystore_round_trip_two_accounts_and_delete(fleet, tmp_path):
    backend = FileKeyring(tmp_path / "kr")
    a, b = KeyStore("agent-a", backend=backend), KeyStore("agent-b", backend=backend)
    assert a.load() is None
    creds_a, creds_b = fleet.issue_credentials("a", role=Role.AGENT), fleet.issue_credentials("b", role=Role.AGENT)
    a.save(creds_a)
    b.save(creds_b)
    assert KeyStore("agent-a", backend=FileKeyring(tmp_path / "kr")).load() == creds_a
    assert b.load() == creds_b
    if sys.platform != "win32":
        assert stat.S_IMODE(backend.path.stat().st_mode) == 0o600
    raw = json.loads(backend.path.read_text())["deskfleet"]
    assert set(raw) == {f"agent-{x}/{p}" for x in "ab" for p in ("ca", "cert", "key")}
    assert all("\n" not in v and len(v) < 1200 for v in raw.values())  # fits Windows' 2560-byte UTF-16 cap
    a.delete()
    assert a.load() is None and b.load() == creds_b
    a.delete()  # idempotent


def test_keystore_reports_partial_and_damaged_contents(fleet, tmp_path):
    backend = FileKeyring(tmp_path)
    store = KeyStore("agent", backend=backend)
    store.save(fleet.issue_credentials("a", role=Role.CONSOLE))
    backend.set_password("deskfleet", "agent/cert", "!!!not base64")
    with pytest.raises(CredentialsError, match="damaged"):
        store.load()
    backend.delete_password("deskfleet", "agent/cert")
    with pytest.raises(KeyStoreError, match="missing: cert"):
        store.load()
    backend.path.write_text("[1, 2")
    with pytest.raises(KeyStoreError, match="unreadable"):
        store.load()


def test_file_keyring_is_chosen_only_instead_of_the_fail_backend(tmp_path, monkeypatch):
    monkeypatch.setenv(KEYRING_DIR, str(tmp_path))
    monkeypatch.setattr(keyring, "get_keyring", lambda: keyring.backends.fail.Keyring())
    chosen = default_backend()
    assert isinstance(chosen, FileKeyring) and chosen.path.parent == tmp_path
    real = FileKeyring(tmp_path / "pretend-os-keyring")
    monkeypatch.setattr(keyring, "get_keyring", lambda: real)
    assert KeyStore("x").backend is real
    assert not any(isinstance(k, FileKeyring) for k in keyring.backend.get_all_keyring())
