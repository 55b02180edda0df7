"""Joining the fleet: the console's enrollment service and the agent's join client (aiohttp, HTTPS).

The agent has no certificate yet, so this is the one endpoint that is TLS without client
authentication; the caller proves itself with a join token instead (single use by default, or
N uses; see :mod:`engine.trust.join_token`). The agent in turn
trusts nothing the console says until the CA it serves matches the pin inside the token:

1. ``GET /v1/ca`` over unverified TLS -> the CA PEM; the agent compares its sha256 to the pin.
2. ``POST /v1/join`` ``{token, csr_pem, name, info?}`` over TLS verified against that CA ->
   ``{cert_pem, ca_pem, fleet_id, node_id, api_key?}``; ``api_key`` is the API key of the PC's tray
   chat, issued to it by name (``tray-<name>-<node id prefix>``) in the fleet's key book, shown
   only in this answer, revoked when the PC is removed. The agent's key never leaves it, only its CSR.
   Before the token is written, the server's certificate must carry the console role: every
   member's certificate chains to the same CA (and may serve TLS), so the CA alone does not
   tell the console from an enrolled PC posing as it. The console's node id (the sha256 of that
   certificate) is what the agent then pins: its control API takes orders from that id only.

A refused token is answered 403 with its reason (``engine.errors.JOIN_REFUSALS``) and logged.
An admitted PC is recorded in the token book against the token that admitted it, and written to
the enrolment audit (:mod:`engine.control.join_audit`) with the token's id and label.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from engine.atomic_file import write_bytes_atomic
from engine.control.join_audit import JoinAudit
from engine.errors import (
    CertificateRequestError,
    CredentialsError,
    DeskfleetError,
    EnrollmentError,
    EnrollmentTimeout,
    JoinRefused,
    TokenBookError,
    WrongFleetError,
)
from engine.http_limits import DEFAULT_LIMITS, ConnectionLimits, LimitedAppRunner, LimitedSite
from engine.trust.fleet_ca import (
    LEAF_DAYS,
    Credentials,
    FleetAuthority,
    Role,
    ca_fingerprint,
    check_request,
    fleet_id_of,
    make_key_and_csr,
    peer_node_id,
    sanitize_name,
)
from engine.trust.join_token import TokenBook, parse_token
from engine.trust.tls_peer import (
    PeerCheckingConnector,
    PeerIdentityError,
    async_read_limited,
    expect_peer,
)

log = logging.getLogger("deskfleet.enrollment")

MAX_JOIN_BYTES = 64 << 10  # a CSR is ~0.5 KB; info is a handful of hardware facts
MAX_CA_BYTES = 16 << 10
JOIN_TIMEOUT = 10.0
PEM_TYPE = "application/x-pem-file"
REFUSALS_AUDITED = 20  # audit lines per known token per window for refused joins (the rest counted)
REFUSAL_WINDOW_S = 3600.0
MAX_REFUSAL_TOKENS = 1024  # tokens tracked for that count (the book's, so few; cleared beyond)

class NotTheConsoleError(EnrollmentError):
    """Raised on an agent when the server at the console's address holds a certificate of the
    fleet that is not the console's (another member posing as it): the join token was not sent,
    so it is still good for the real console."""


@dataclass(frozen=True)
class Joined:
    """A successful join: this PC's new credentials and the node id of the console that admitted
    it (the sha256 of the console certificate the join was made over, not anything it wrote)."""

    credentials: Credentials
    console_node_id: str
    api_key: str | None = field(default=None, repr=False)  # the tray chat's own API key (None: an older console)


# on_join(node_id, name, info): told of every admitted PC, after its certificate is signed.
JoinCallback = Callable[[str, str, Mapping[str, Any]], Awaitable[None] | None]
# issue_chat_key(node_id, name) -> the secret of a new API key for that PC's tray chat.
ChatKeyIssuer = Callable[[str, str], str]


def _error(status: int, message: str, reason: str) -> web.Response:
    return web.json_response({"error": message, "reason": reason}, status=status)


class EnrollmentServer:
    """The console's join endpoint: trades a valid join token and a CSR for a fleet certificate."""

    def __init__(self, authority: FleetAuthority, token_book: TokenBook, console_credentials: Credentials, *,
                 on_join: JoinCallback | None = None, issue_chat_key: ChatKeyIssuer | None = None,
                 cert_days: int = LEAF_DAYS, max_body_bytes: int = MAX_JOIN_BYTES,
                 audit: JoinAudit | None = None, limits: ConnectionLimits = DEFAULT_LIMITS) -> None:
        self._authority = authority
        self._tokens = token_book
        self._credentials = console_credentials
        self._on_join = on_join
        self._issue_chat_key = issue_chat_key
        self._cert_days = cert_days
        self._max_body_bytes = max_body_bytes
        self._audit = audit
        self.limits = limits
        self._refusals: dict[str, tuple[float, int, int]] = {}  # token id -> (window start, written, held back)
        self._runner: LimitedAppRunner | None = None

    async def async_start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen on ``host:port`` (0: any free port) and return the bound address."""
        app = web.Application(client_max_size=self._max_body_bytes)
        app.router.add_get("/v1/ca", self._async_ca)
        app.router.add_post("/v1/join", self._async_join)
        runner = LimitedAppRunner(app, shutdown_timeout=2.0, access_log=None, limits=self.limits,
                                  what="enrollment endpoint")
        await runner.setup()
        try:
            site = LimitedSite(runner, host, port,
                               ssl_context=self._credentials.server_context(verify_clients=False))
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise EnrollmentError(f"cannot listen for joining PCs on {host}:{port} ({exc}); pick another "
                                  "port or stop the program using it") from exc
        self._runner = runner
        bound = runner.addresses[0]
        return bound[0], bound[1]

    async def async_close(self) -> None:
        """Stop listening; requests in flight get the runner's short grace period."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _async_ca(self, request: web.Request) -> web.Response:
        return web.Response(body=self._authority.ca_pem, content_type=PEM_TYPE)

    async def _async_join(self, request: web.Request) -> web.Response:
        peer = request.remote or "?"
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(peer, 400, f"the join request is larger than {self._max_body_bytes} bytes",
                                "too_large")
        fields = _parse_join(body)
        if isinstance(fields, str):
            return self._refuse(peer, 400, fields, "bad_request")
        token, csr_pem, name, info = fields
        try:
            check_request(csr_pem)  # before redeeming: a broken CSR must not use up the token
        except CertificateRequestError as exc:
            return self._refuse(peer, 400, str(exc), "bad_csr", name)
        try:
            redeemed = await asyncio.to_thread(self._tokens.redeem, token)  # a locked book rewrite: off the loop
        except JoinRefused as exc:
            if exc.token_id is not None:
                self._audit_refusal(exc, name, peer)
            return self._refuse(peer, 403, str(exc), exc.reason, name)
        except TokenBookError as exc:
            log.error("join from %s (%s) failed: %s", peer, name, exc)
            return _error(500, "the console cannot read its join-token book; ask the admin to look at "
                               "the console's log", "internal")
        cert_pem = self._authority.sign_request(csr_pem, role=Role.AGENT, days=self._cert_days, name=name)
        node_id = _node_id(cert_pem)
        log.info("admitted %s from %s as node %s (token %s)", name, peer, node_id[:16], redeemed.token_id)
        try:
            await asyncio.to_thread(self._tokens.record_admission, redeemed.token_id, node_id, name)
        except TokenBookError as exc:  # the PC is admitted; only the book's note of it is lost
            log.error("cannot note in the join-token book that token %s admitted %s: %s", redeemed.token_id,
                      node_id[:16], exc)
        if self._audit is not None:
            self._audit.write("admitted", node_id=node_id, name=name, token_id=redeemed.token_id,
                              token_label=redeemed.label, remote=peer, auto_approve=redeemed.auto_approve)
        if self._on_join is not None:
            try:
                result = self._on_join(node_id, name, info)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("the join callback failed for node %s (%s)", node_id[:16], name)
                return _error(500, "the console signed the certificate but could not record the PC; "
                                   "ask the admin to look at the console's log", "internal")
        answer = {"cert_pem": cert_pem.decode("ascii"), "ca_pem": self._authority.ca_pem.decode("ascii"),
                  "fleet_id": self._authority.fleet_id, "node_id": node_id}
        if self._issue_chat_key is not None:
            try:
                answer["api_key"] = await asyncio.to_thread(self._issue_chat_key, node_id, name)  # a book rewrite
            except DeskfleetError as exc:
                log.error("cannot issue the chat key of node %s (%s): %s", node_id[:16], name, exc)
                return _error(500, "the console signed the certificate but could not issue the PC's chat key; "
                                   "ask the admin to look at the console's log", "internal")
        return web.json_response(answer)

    def _audit_refusal(self, exc: JoinRefused, name: str, peer: str) -> None:
        """An audit line for a refused join with a token the book knows, at most REFUSALS_AUDITED per
        token per hour (a leaked token replayed in a loop must not grow the file without bound); the
        lines held back are counted in the next one written."""
        if self._audit is None or exc.token_id is None:
            return
        now = time.monotonic()
        if len(self._refusals) >= MAX_REFUSAL_TOKENS and exc.token_id not in self._refusals:
            self._refusals.clear()
        start, written, held = self._refusals.get(exc.token_id, (now, 0, 0))
        if now - start > REFUSAL_WINDOW_S:
            start, written = now, 0
        if written >= REFUSALS_AUDITED:
            self._refusals[exc.token_id] = (start, written, held + 1)
            return
        self._refusals[exc.token_id] = (start, written + 1, 0)
        self._audit.write("refused", node_id="", name=name, token_id=exc.token_id, token_label=exc.token_label,
                          remote=peer, reason=exc.reason, **({"held_back": held} if held else {}))

    def _refuse(self, peer: str, status: int, message: str, reason: str, name: str = "?") -> web.Response:
        log.warning("join refused for %s from %s: %s (%s)", name, peer, reason, message)
        return _error(status, message, reason)


def _node_id(cert_pem: bytes) -> str:
    return peer_node_id(x509.load_pem_x509_certificate(cert_pem).public_bytes(Encoding.DER))


def _parse_join(body: bytes) -> tuple[str, str, str, dict[str, Any]] | str:
    """The join request's (token, csr_pem, sanitised name, info), or what is wrong with it."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "the join request is not JSON; send {\"token\", \"csr_pem\", \"name\", \"info\"?}"
    if not isinstance(doc, dict):
        return "the join request must be a JSON object"
    missing = [k for k in ("token", "csr_pem", "name") if not isinstance(doc.get(k), str) or not doc[k]]
    if missing:
        return f"the join request lacks {', '.join(missing)} (non-empty strings)"
    info = doc.get("info") or {}
    if not isinstance(info, dict):
        return "the join request's info must be a JSON object"
    return doc["token"], doc["csr_pem"], sanitize_name(doc["name"]), info


# -- the console's own certificate ---------------------------------------------------------------

CONSOLE_CERT = "console.crt"
CONSOLE_KEY = "console.key"
RENEW_BEFORE = datetime.timedelta(days=7)


def load_or_create_console_credentials(state_dir: Path, authority: FleetAuthority,
                                       name: str = "console") -> Credentials:
    """The console's fleet certificate, kept in ``state_dir`` (key 0600 beside the CA key) so that
    its node id — which every agent pins at its join — survives a restart. A new one is issued
    (and the agents must join again; logged) only when none is stored, when it no longer fits
    the CA or has lost the console role, or when it expires within RENEW_BEFORE."""
    cert, key = state_dir / CONSOLE_CERT, state_dir / CONSOLE_KEY
    if cert.exists() and key.exists():
        try:
            creds = Credentials(authority.ca_pem, cert.read_bytes(), key.read_bytes())
        except (CredentialsError, OSError) as exc:
            log.warning("the console certificate in %s is unusable (%s): issuing a new one; agents "
                        "that joined through the old one must join again", state_dir, exc)
        else:
            fresh = creds.not_after - datetime.datetime.now(datetime.UTC) > RENEW_BEFORE
            if creds.role is Role.CONSOLE and fresh:
                return creds
            log.warning("the console certificate in %s expires on %s: issuing a new one; agents must "
                        "join again", state_dir, creds.not_after.date())
    state_dir.mkdir(parents=True, exist_ok=True)
    creds = authority.issue_credentials(name, role=Role.CONSOLE)
    write_bytes_atomic(key, creds.key_pem)
    cert.write_bytes(creds.cert_pem)
    return creds


# -- the agent side ----------------------------------------------------------------------------

def split_address(console: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); EnrollmentError if it is neither."""
    host, sep, port = console.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EnrollmentError(f"the console address {console!r} should be host:port, e.g. 192.168.1.10:7411 "
                              "as shown in the console")
    return host, int(port)


def _pinned_context(ca_pem: bytes) -> ssl.SSLContext:
    """A client context that trusts only ``ca_pem``, with no certificate of its own (not yet)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # as every fleet context (engine.trust.fleet_ca)
    ctx.check_hostname = False  # the console is reached by IP; its identity is the pinned CA
    ctx.load_verify_locations(cadata=ca_pem.decode("ascii"))
    return ctx


async def _async_read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    return await async_read_limited(
        resp, limit, lambda message: EnrollmentError(f"{message}; this is not a Deskfleet console"))


async def async_join(console: str, token: str, name: str, *, info: Mapping[str, Any] | None = None,
                     timeout: float = JOIN_TIMEOUT) -> Joined:
    """Join the fleet whose console listens at ``console`` ("host:port") with a join token.

    Raises JoinTokenError (mistyped token, nothing sent), WrongFleetError (the console's CA is
    not the one the token pins; the CSR is not sent), NotTheConsoleError (a member that is not
    the console answered; the token is not sent), JoinRefused (the console refused the token),
    EnrollmentTimeout (a step took longer than ``timeout`` s in all), EnrollmentError.
    """
    pinned = parse_token(token)
    host, port = split_address(console)
    base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    step = "connecting"
    try:
        # force_close: the join must never ride on the connection the CA was fetched over unverified.
        async with asyncio.timeout(timeout), aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            step = "fetching the fleet CA"
            async with session.get(f"{base}/v1/ca", ssl=False) as resp:  # checked against the pin below
                if resp.status != 200:
                    raise EnrollmentError(f"the console at {console} answered {resp.status} for its CA; "
                                          "is this a Deskfleet console?")
                ca_pem = await _async_read_limited(resp, MAX_CA_BYTES)
            try:
                served = ca_fingerprint(ca_pem)
            except CredentialsError as exc:
                raise EnrollmentError(f"the console at {console} sent no readable CA certificate") from exc
            if not pinned.pins(served):
                raise WrongFleetError(
                    f"this console is not the fleet your token is for: {console} serves fleet "
                    f"{fleet_id_of(served)}, the token was issued by fleet {pinned.ca_pin[:16]}. "
                    "Check the console address, or ask the admin of this console for a token")
            key_pem, csr_pem = make_key_and_csr(name)
            step = "sending the join request"
            request = {"token": pinned.text, "csr_pem": csr_pem.decode("ascii"), "name": name, "info": dict(info or {})}
            # A second session whose connector checks the console role on the new TLS connection
            # before the request (and so the token) is written to it.
            checked = PeerCheckingConnector(expect_peer(Role.CONSOLE, what=f"the server at {console}"),
                                            force_close=True)
            join_timeout = aiohttp.ClientTimeout(total=timeout)
            async with aiohttp.ClientSession(connector=checked, timeout=join_timeout) as joining:
                async with joining.post(f"{base}/v1/join", json=request, ssl=_pinned_context(ca_pem)) as resp:
                    answer = await _async_read_limited(resp, MAX_CA_BYTES * 4)
                    status = resp.status
            console_node_id = checked.seen
    except PeerIdentityError as exc:
        log.warning("join at %s refused before sending the token: %s", console, exc)
        raise NotTheConsoleError(f"{exc}. The join token was not sent and is still good; check the console "
                                 "address, and tell the admin: a fleet member may be posing as the console") from exc
    except TimeoutError:
        raise EnrollmentTimeout(f"the console at {console} did not answer within {timeout:g} s while "
                                f"{step}; check that it is running and reachable") from None
    except aiohttp.ClientConnectorCertificateError as exc:
        raise EnrollmentError(f"the console at {console} presented a TLS certificate its own CA did not "
                              f"sign ({exc.certificate_error}); something may be in between: do not retry "
                              "on this network, tell the admin") from exc
    except aiohttp.ClientConnectorError as exc:
        raise EnrollmentError(f"cannot connect to the console at {console} ({exc.os_error}); check the "
                              "address and that the console is running") from exc
    except aiohttp.ClientError as exc:
        raise EnrollmentError(f"the connection to the console at {console} failed while {step} ({exc})") from exc
    assert console_node_id is not None  # the connector checked (and so saw) the console's certificate
    creds, api_key = _credentials_from(console, status, answer, ca_pem, key_pem)
    return Joined(creds, console_node_id, api_key)


def _credentials_from(console: str, status: int, answer: bytes, ca_pem: bytes,
                      key_pem: bytes) -> tuple[Credentials, str | None]:
    """The credentials (and the tray's API key, if sent) in the console's join answer, or the error it reports."""
    try:
        doc = json.loads(answer)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
    except ValueError:
        raise EnrollmentError(f"the console at {console} answered {status} with something that is not "
                              "JSON; is this a Deskfleet console of the same version?") from None
    if status == 403:
        raise JoinRefused(str(doc.get("reason", "refused")))
    if status != 200:
        raise EnrollmentError(f"the console at {console} refused the join ({status}): {doc.get('error', '?')}")
    if str(doc.get("ca_pem", "")).encode("ascii", "replace") != ca_pem:
        raise EnrollmentError(f"the console at {console} answered with another CA than it served a moment "
                              "ago; join again, and tell the admin if it repeats")
    try:
        creds = Credentials(ca_pem, str(doc.get("cert_pem", "")).encode("ascii", "replace"), key_pem)
    except CredentialsError as exc:
        raise EnrollmentError(f"the console at {console} answered with a certificate that does not fit this "
                              f"PC's key or fleet ({exc})") from exc
    api_key = doc.get("api_key")
    if api_key is not None and (not isinstance(api_key, str) or not 0 < len(api_key) <= 256
                                or not api_key.isascii() or not api_key.isprintable()):
        raise EnrollmentError(f"the console at {console} answered with a malformed API key; join again, and "
                              "tell the admin if it repeats")
    log.info("joined fleet %s as node %s", creds.fleet_id, creds.node_id[:16])
    return creds, api_key
