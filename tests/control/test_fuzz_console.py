"""Hostile input against the console's two live endpoints, the enrollment server and the hub (issue 7).

One console half (``engine.control.fleet_services``) on loopback for the module, publishing the tiny 2-stage
export. Enrollment gets join bodies built from tokens of every kind (fresh, replayed, expired,
another fleet's, mistyped, junk), certificate requests of every kind (valid, tampered, RSA-1024,
Ed25519, not a CSR at all, oversized) and hostile names and info; an independent prediction says
which of 200 / 400 bad_request / 400 bad_csr / 403 <reason> each must get. The hub gets shard paths
with traversal attempts of every spelling and Range headers of every shape over mutual TLS: a
published file comes back exactly (from the asked offset), anything else is a 4xx, and no byte of
an unpublished file (a secret next to the export, an unlisted file inside it) ever leaves.
"""

from __future__ import annotations

import base64
import posixpath
import shutil
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import unquote

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from cryptography.x509.oid import NameOID
from hypothesis import example, given
from hypothesis import strategies as st

from engine.control.hub_events import MemberRate
from engine.errors import CertificateRequestError, JoinTokenError
from engine.shards.manifest import load_manifest
from engine.trust.fleet_ca import FleetAuthority, Role, check_request, make_key_and_csr
from engine.trust.join_token import JoinToken, parse_token
from tests.support.agent_helpers import console
from tests.support.fuzz_helpers import (
    CONTENT_TYPES,
    LIVE_FUZZ,
    METHODS,
    RAW_BODIES,
    TRAVERSALS,
    Blob,
    HttpClient,
    assert_answered,
    assert_clean_refusal,
    dumps,
    fuzz_settings,
    json_values,
    loop_thread,
    paths,
)

pytestmark = LIVE_FUZZ

CASES = {"enrollment: join bodies": 1000, "enrollment: raw requests": 400, "hub: shard paths and ranges": 1200,
         "hub: registrations and events": 300}
SECRET = b"DESKFLEET-FUZZ-SECRET-" * 8
POOL = 40


@dataclass
class Console:
    enrollment: HttpClient
    hub: HttpClient
    fresh: list[str]  # issued, unused at the start
    expired: list[str]
    used: list[str]
    files: dict[str, bytes]  # published path -> content
    fingerprint: str
    ca_pem: str
    redeemed: set[str] = field(default_factory=set)  # secret hashes the fuzzing used up
    outcomes: dict[str, int] = field(default_factory=dict)


def _other_csrs() -> dict[str, str]:
    """Certificate requests the console must refuse, and one it must accept."""
    def csr(key, algorithm):
        return (x509.CertificateSigningRequestBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pc")]))
                .sign(key, algorithm).public_bytes(serialization.Encoding.PEM).decode())

    good = make_key_and_csr("pc")[1].decode()
    body = "".join(good.splitlines()[1:-1])
    raw = bytearray(base64.b64decode(body))
    raw[len(raw) // 2] ^= 0x01  # inside the public key: the self-signature no longer verifies
    tampered = "-----BEGIN CERTIFICATE REQUEST-----\n" + base64.b64encode(bytes(raw)).decode() \
        + "\n-----END CERTIFICATE REQUEST-----\n"
    return {"good": good, "good2": make_key_and_csr("\u00e9t\u00e9 \U0001f600")[1].decode(),
            "tampered": tampered, "rsa1024": csr(rsa.generate_private_key(65537, 1024), hashes.SHA256()),
            "ed25519": csr(ed25519.Ed25519PrivateKey.generate(), None),
            "truncated": good[: len(good) // 2], "header only": "-----BEGIN CERTIFICATE REQUEST-----\n",
            "certificate": FleetAuthority.create("x").ca_pem.decode(), "huge": good + "A" * (20 << 10)}


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_export):
    root = tmp_path_factory.mktemp("fuzz-console")
    export = root / "exports" / "tiny-2"
    shutil.copytree(tiny_export("llama", 2), export)
    (root / "exports" / "secret.txt").write_bytes(SECRET)
    (export / "stage_1" / "unlisted.bin").write_bytes(SECRET)
    manifest = load_manifest(export)
    files = {e.path: (export / e.path).read_bytes() for s in manifest.stages for e in s.files}
    files.update({e.path: (export / e.path).read_bytes() for e in manifest.tokenizer_files})
    with loop_thread() as loop:
        cm = console(root / "console", {"tiny-2": export})
        con = loop.run(cm.__aenter__())
        try:
            fresh = [con.token() for _ in range(POOL)]
            expired = [con.token(ttl_s=0.05) for _ in range(5)]
            used = [con.token() for _ in range(3)]
            for token in used:
                con.tokens.redeem(token)
            time.sleep(0.1)
            anonymous = ssl.create_default_context(cadata=con.authority.ca_pem.decode())
            anonymous.check_hostname = False
            member_creds = con.authority.issue_credentials("desk-9", role=Role.AGENT)
            con.hub.rate = MemberRate(per_minute=1e9, burst=10**9)  # the parser, not the rate (tests/security)
            con.hub.grant(member_creds.node_id, "tiny-2", range(len(manifest.stages)))  # as if assigned each stage
            member = member_creds.client_context()
            host, port = con.enrollment.rsplit(":", 1)
            clients = (HttpClient(host, int(port), anonymous), HttpClient(con.hub.host, con.hub.port, member))
            yield Console(*clients, fresh, expired, used, files, con.authority.fingerprint,
                          con.authority.ca_pem.decode())
            for c in clients:
                c.close()
        finally:
            loop.run(cm.__aexit__(None, None, None))



# -- enrollment ------------------------------------------------------------------------------------

CSRS = _other_csrs()
OTHER_FLEET = FleetAuthority.create("other fleet").fingerprint


@st.composite
def tokens(draw, live: Console):
    kind = draw(st.sampled_from(["fresh", "fresh", "fresh", "expired", "used", "other", "unknown", "typo",
                                 "spaced", "junk"]))
    if kind in ("fresh", "expired", "used"):
        return draw(st.sampled_from(getattr(live, kind)))
    if kind == "other":
        return JoinToken.new(OTHER_FLEET).text
    if kind == "unknown":
        return JoinToken.new(live.fingerprint).text
    token = draw(st.sampled_from(live.fresh))
    if kind == "spaced":  # whitespace and case do not matter to the parser
        return " " + token.lower().replace("-", " - ", 1) + "\n"
    if kind == "typo":
        i = draw(st.integers(5, len(token) - 1))
        return token[:i] + draw(st.sampled_from("ABCXYZ234567abc0-")) + token[i + 1:]
    return draw(st.text(max_size=60) | st.sampled_from(["DFJ1", "DFJ1----", "DFJ1-" + "a" * 32 + "-x-y"]))


@st.composite
def join_bodies(draw, live: Console):
    body = {"token": draw(tokens(live) | json_values(2) if draw(st.integers(0, 9)) == 0 else tokens(live)),
            "csr_pem": draw(st.sampled_from(sorted(CSRS)).map(CSRS.get) | json_values(2)
                            if draw(st.integers(0, 9)) == 0 else st.sampled_from(sorted(CSRS)).map(CSRS.get)),
            "name": draw(st.sampled_from(["desk", "\u00e9t\u00e9 PC", "x" * 500, "\u0000\n../../", "", " "])
                         | st.text(max_size=30) | json_values(1)),
            "info": draw(st.sampled_from([None, {}, {"os": "linux"}, [], "x", 3]) | json_values(3))}
    for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        del body[name]
    return body


def predict_join(live: Console, body: dict) -> tuple[int, str]:
    """(status, reason) the enrollment server must answer, from the documented rules."""
    if not all(isinstance(body.get(k), str) and body[k] for k in ("token", "csr_pem", "name")):
        return 400, "bad_request"
    if body.get("info") and not isinstance(body["info"], dict):
        return 400, "bad_request"
    try:
        check_request(body["csr_pem"])
    except CertificateRequestError:
        return 400, "bad_csr"
    try:
        token = parse_token(body["token"])
    except JoinTokenError:
        return 403, "malformed"
    if not token.pins(live.fingerprint):
        return 403, "other_fleet"
    issued = {parse_token(t).secret_hash: kind for kind in ("fresh", "expired", "used") for t in getattr(live, kind)}
    kind = issued.get(token.secret_hash)
    if kind is None:
        return 403, "unknown"
    if kind == "used" or token.secret_hash in live.redeemed:
        return 403, "used"
    if kind == "expired":
        return 403, "expired"
    live.redeemed.add(token.secret_hash)
    return 200, ""


def test_fuzz_join_bodies(live):
    ran = []
    # Each refusal of a well-formed body once for certain (generated bodies reach the token checks
    # only a few dozen times in a thousand, so a rare kind may otherwise go unseen).
    well_formed = {"csr_pem": CSRS["good"], "name": "desk", "info": {"os": "linux"}}
    sure = [{**well_formed, "token": token} for token in (live.expired[0], live.used[0], "DFJ1----",
                                                          JoinToken.new(OTHER_FLEET).text,
                                                          JoinToken.new(live.fingerprint).text)]

    @fuzz_settings(CASES["enrollment: join bodies"])
    @given(body=join_bodies(live))
    @example(body=sure[0])
    @example(body=sure[1])
    @example(body=sure[2])
    @example(body=sure[3])
    @example(body=sure[4])
    def case(body):
        ran.append(1)
        reply = live.enrollment.request("POST", "/v1/join", dumps(body), {"Content-Type": "application/json"})
        status, reason = predict_join(live, body)
        what = f"join {dumps(body)[:160]!r}"
        assert_answered(reply, what)
        live.outcomes[reason or "admitted"] = live.outcomes.get(reason or "admitted", 0) + 1
        if status == 200:
            assert reply.status == 200, f"{what}: {reply.body[:300]!r}"
            doc = reply.json()
            cert = x509.load_pem_x509_certificate(doc["cert_pem"].encode())
            assert doc["ca_pem"] == live.ca_pem and doc["node_id"] and cert.issuer != cert.subject, what
        else:
            assert_clean_refusal(reply, what, json_error=lambda d: isinstance(d, dict) and bool(d.get("error")))
            assert (reply.status, reply.json()["reason"]) == (status, reason), f"{what}: {reply.body[:300]!r}"

    case()
    assert len(ran) >= CASES["enrollment: join bodies"]
    assert {"admitted", "bad_request", "bad_csr", "malformed", "used", "expired", "unknown", "other_fleet"} \
        <= set(live.outcomes), live.outcomes


def test_fuzz_enrollment_raw_requests(live):
    ran = []

    @fuzz_settings(CASES["enrollment: raw requests"])
    @given(method=st.sampled_from(METHODS), path=st.sampled_from(("/v1/join", "/v1/ca")) | paths(("/v1/join",)),
           body=st.sampled_from(RAW_BODIES) | st.binary(max_size=200).map(Blob)
           | st.integers((64 << 10) + 1, 300 << 10).map(lambda n: Blob(b"{\"token\": \"" + b"x" * n + b"\"}")),
           content_type=st.sampled_from(CONTENT_TYPES))
    def case(method, path, body, content_type):
        ran.append(1)
        reply = live.enrollment.request(method, path, body, {"Content-Type": content_type})
        what = f"{method} {path[:80]} ({len(body)} B)"
        assert_answered(reply, what)
        if method == "POST" and path == "/v1/join":
            assert_clean_refusal(reply, what, json_error=lambda d: isinstance(d, dict) and bool(d.get("reason")))
            if len(body) > 64 << 10:
                assert reply.json()["reason"] == "too_large", what
        elif method in ("GET", "HEAD") and path == "/v1/ca":
            assert reply.status == 200
        elif method != "HEAD":
            assert_clean_refusal(reply, what)

    case()
    assert len(ran) >= CASES["enrollment: raw requests"]


# -- the hub ---------------------------------------------------------------------------------------

SPELLINGS = ("{p}", "{p}", "{p}", "../{p}", "{p}/..", "stage_1/../{p}", "./{p}", "{p}%00", "%2e%2e/{p}",
             "{p}/../../secret.txt", "..%2f..%2fsecret.txt", "../secret.txt", "%2E%2E%2Fsecret.txt",
             "stage_1/unlisted.bin", "stage_1//unlisted.bin", "/etc/passwd", "{p}?x=1", "{p}#frag",
             "{p}%20", "{P}", "%252e%252e%252fsecret.txt", "..\\secret.txt", "stage_1\\..\\..\\secret.txt")
RANGES = ("", "bytes=0-", "bytes={n}-", "bytes={n}-", "bytes={big}-", "bytes=-{n}", "bytes={n}-{m}",
          "bytes=5-2", "bytes=0-1,3-4", "bytes=x-", "items=0-", "bytes=", "bytes=-", "bytes=99999999999999999999-",
          "bytes=\u00e9-", "bytes = 1 -")


@st.composite
def shard_requests(draw, live: Console):
    """(method, export id, path, Range): four in ten an honest fetch, the rest anything."""
    rel = draw(st.sampled_from(sorted(live.files)))
    size = len(live.files[rel])
    n = draw(st.integers(0, size + 2))
    range_ = draw(st.sampled_from(RANGES)).format(n=n, m=n + draw(st.integers(-3, 50)), big=size + 1 + n)
    if draw(st.integers(0, 9)) < 4:
        return draw(st.sampled_from(["GET", "GET", "HEAD"])), "tiny-2", rel, range_
    spelling = draw(st.sampled_from(SPELLINGS) | st.lists(st.sampled_from(TRAVERSALS), min_size=1, max_size=3)
                    .map("/".join))
    export_id = draw(st.sampled_from(["tiny-2", "tiny-2", "tiny-2", "..", "tiny-2/..", "other", "%2e%2e", ""]))
    method = draw(st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "PUT", "DELETE"]))
    return method, export_id, spelling.format(p=rel, P=rel.upper()), range_


def _published(live: Console, url_path: str) -> bytes | None:
    """The published file a URL names once its query and fragment are cut, its escapes decoded and
    its dot segments removed (RFC 3986), whether or not the server does all of that itself."""
    path = posixpath.normpath(unquote(url_path.split("?")[0].split("#")[0]))
    prefix = "/v1/shards/tiny-2/"
    return live.files.get(path[len(prefix):]) if path.startswith(prefix) else None


def test_fuzz_shard_paths_and_ranges(live):
    ran = []
    served = {"whole": 0, "partial": 0, "refused": 0}

    @fuzz_settings(CASES["hub: shard paths and ranges"])
    @given(request=shard_requests(live))
    def case(request):
        ran.append(1)
        method, export_id, path, range_ = request
        headers = {"Range": range_.encode().decode("latin-1")} if range_ else {}
        url = f"/v1/shards/{export_id}/{path}"
        reply = live.hub.request(method, url, b"", headers)
        what = f"{method} {url} Range {range_!r}"
        assert_answered(reply, what)
        assert SECRET[:20] not in reply.body, f"{what}: an unpublished file was served"
        content = _published(live, url)
        if reply.status in (200, 206):
            assert method in ("GET", "HEAD") and content is not None, f"{what}: served something unpublished"
            if method == "GET":
                start = int(reply.headers.get("content-range", "bytes 0-").split()[1].split("-")[0]) \
                    if reply.status == 206 else 0
                assert reply.body == content[start:], f"{what}: wrong bytes"
            served["partial" if reply.status == 206 else "whole"] += 1
        else:
            assert_clean_refusal(reply, what)
            served["refused"] += 1
        if content is None and method == "GET":
            assert reply.status in (404, 400), f"{what}: {reply.status}"

    case()
    assert len(ran) >= CASES["hub: shard paths and ranges"]
    assert min(served.values()) >= 50, served


def test_fuzz_registrations_and_events(live):
    ran = []

    @fuzz_settings(CASES["hub: registrations and events"])
    @given(path=st.sampled_from(["/v1/register", "/v1/events"]),
           body=json_values().map(dumps) | st.sampled_from(RAW_BODIES)
           | st.fixed_dictionaries({"event": st.sampled_from(["paused", "resumed", "x", None, 1]),
                                    "reasons": json_values(2)}).map(dumps),
           content_type=st.sampled_from(CONTENT_TYPES))
    def case(path, body, content_type):
        ran.append(1)
        reply = live.hub.request("POST", path, body, {"Content-Type": content_type})
        assert_answered(reply, f"{path} {body[:80]!r}")
        if reply.status != 200:
            assert_clean_refusal(reply, path, json_error=lambda d: bool(d.get("error", {}).get("message")))

    case()
    assert len(ran) >= CASES["hub: registrations and events"]


def test_fuzzed_console_still_admits_and_serves(live):
    manifest = live.hub.request("GET", "/v1/shards/tiny-2/" + next(iter(live.files)))
    assert manifest.status == 200
    assert live.enrollment.request("GET", "/v1/ca").status == 200
