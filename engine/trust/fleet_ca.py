"""The fleet's certificate authority and the credentials it issues (no sockets, no Qt).

The console owns a :class:`FleetAuthority`: a self-signed EC P-256 CA that signs every member's
certificate. A member's :class:`Credentials` are the CA certificate, its own certificate and its
key; they build the SSL contexts for every control- and data-plane connection, which are mutual
TLS with the fleet CA as the only trust anchor. A node's id is the sha256 of its certificate
(DER), so it cannot be claimed without the matching key. Join tokens, the one-time secret an
agent joins with, live in :mod:`engine.trust.join_token`; :mod:`engine.control.enrollment` carries the join.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import re
import secrets
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from engine.errors import CertificateRequestError, CredentialsError

CA_DAYS = 3650
LEAF_DAYS = 365
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates start this early: PC clocks drift
MAX_NAME = 64  # the X.509 upper bound on a common name, in UTF-8 bytes
MAX_CSR_BYTES = 16 << 10
# Keys we sign for: (type, allowed sizes). EC by curve, RSA by modulus bits.
EC_CURVES = frozenset({"secp256r1", "secp384r1", "secp521r1"})
RSA_BITS = range(2048, 8192 + 1)
ORGANISATION = "Deskfleet"

log = logging.getLogger(__name__)
# OpenSSL's reason for a refused handshake -> what it means, for the log of the refusing server.
TLS_REFUSALS = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "it presented no certificate",
    "CERTIFICATE_VERIFY_FAILED": "its certificate is not a valid one from this fleet's CA",
    "TLSV1_ALERT_UNKNOWN_CA": "it does not trust this fleet's CA",
    "WRONG_VERSION_NUMBER": "it does not speak TLS",
    "HTTP_REQUEST": "it sent plain HTTP to a TLS port",
}


class Role(StrEnum):
    """What a certificate's holder is in the fleet; recorded as the certificate's OU.

    ``AGENT``: a PC that serves a stage. ``FLEET_SERVICE``: the fleet service: the one member
    agents take orders from and pin at the join (docs may call it the service certificate).
    ``ADMIN``: a person's console attached to the service's admin API; it gives the service orders
    and is admitted nowhere else, so a stolen admin certificate never reaches an agent's control
    API or a stage's data port.
    """

    AGENT = "agent"
    FLEET_SERVICE = "console"  # the OU every enrolled fleet's service certificate holds: never changes
    CONSOLE = "console"  # the old name of FLEET_SERVICE (an alias: the same member, the same OU)
    ADMIN = "admin"


# Who a server context admits: every fleet port takes members (agents and the service); only the
# service's admin API takes admins, and only admins.
MEMBER_ROLES = frozenset({Role.AGENT, Role.CONSOLE})
ADMIN_ROLES = frozenset({Role.ADMIN})
ADMIN_DAYS = 365
MAX_ADMIN_DAYS = 397  # an admin certificate's longest life (a lost one is revoked; a short life bounds a forgotten one)


# refuse(der) -> why this (CA-signed, role-admitted) peer certificate is refused, or None: a deny list
PeerRefusal = Callable[[bytes], "str | None"]


class PeerRefused(ssl.SSLError):
    """A TLS client presented a certificate of this fleet that the server's deny list refuses (a
    revoked admin certificate on the admin API). Raised from the server's handshake."""


class PeerRoleRefused(ssl.SSLError):
    """A TLS client presented a valid certificate of this fleet whose role the port does not
    admit (an admin certificate on an agent's or a stage's port, a member's on the admin API).
    Raised from the server's handshake, so the client is disconnected before it sends a byte."""


def refuse_role(role: Role | None, admit: frozenset[Role]) -> str | None:
    """Why a peer whose certificate records ``role`` may not use a port that admits ``admit``, or
    None to let it in (pure: the TLS layer acts on the answer)."""
    if role in admit:
        return None
    wanted = " or ".join(sorted(r.value for r in admit)) or "no"
    if role is Role.ADMIN:
        return (f"it presented an admin certificate, which only the fleet service's admin API accepts; "
                f"this port takes {wanted} certificates")
    held = f"of the {role} role" if role else "without a fleet role"
    return f"it presented a certificate {held}; this port takes {wanted} certificates"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def peer_node_id(der: bytes) -> str:
    """The node id of a TLS peer from its certificate (DER, e.g. ``Connection.peer_certificate()``
    or ``ssl_object.getpeercert(binary_form=True)``): the certificate's sha256, hex."""
    return sha256_hex(der)


def peer_role(der: bytes) -> Role | None:
    """The fleet role recorded in a peer's certificate (DER); None if it records none we know."""
    cert = x509.load_der_x509_certificate(der)
    for attr in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME):
        if isinstance(attr.value, str) and attr.value in Role._value2member_map_:
            return Role(attr.value)
    return None


def ca_fingerprint(ca_pem: bytes) -> str:
    """sha256 (hex) of a CA certificate's DER: what a join token pins."""
    return sha256_hex(_load_cert(ca_pem, "CA certificate").public_bytes(serialization.Encoding.DER))


def fleet_id_of(fingerprint: str) -> str:
    """The short fleet id shown to people: the first 16 hex digits of the CA fingerprint."""
    return fingerprint[:16]


def sanitize_name(name: str) -> str:
    """A PC name fit for a certificate CN, a log line and an admin's eye: ASCII letters, digits,
    space, '.', '-' and '_' only, at most 64 characters; anything else becomes '-'. ASCII only
    because Unicode look-alikes ('dеsk-1' with a Cyrillic 'е') would let two PCs show the same
    name. Empty names become 'unnamed'."""
    cleaned = re.sub(r"[^A-Za-z0-9 ._-]", "-", " ".join(str(name).split()))
    return cleaned[:MAX_NAME].strip() or "unnamed"


def _load_cert(pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except (ValueError, TypeError) as exc:
        raise CredentialsError(f"the {what} is not a PEM certificate ({exc}); "
                               "the stored credentials are damaged: leave the fleet and join again") from exc


def _load_key(pem: bytes, password: bytes | None = None) -> ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=password)
    except (ValueError, TypeError) as exc:
        if password is not None:
            raise CredentialsError(f"the private key does not decrypt with the key kept for it ({exc}); "
                                   "the key file or the keyring entry was replaced") from exc
        raise CredentialsError(f"the private key is not an unencrypted PEM key ({exc}); "
                               "the stored credentials are damaged: leave the fleet and join again") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise CredentialsError(f"the private key is a {type(key).__name__}; Deskfleet uses EC or RSA keys")
    return key


def _owns(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, cert: x509.Certificate) -> bool:
    """Whether ``key`` is the private half of the certificate's public key (compared as DER
    SubjectPublicKeyInfo, which is defined for every key type a certificate can carry)."""
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


def _pkcs8(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey,
           encryption: serialization.KeySerializationEncryption | None = None) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             encryption or serialization.NoEncryption())


def _load_chain(ctx: ssl.SSLContext, cert_pem: bytes, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    """Load an in-memory certificate and key into ``ctx``.

    ``load_cert_chain`` only reads files, so the key goes through a temp file in a private (0700)
    directory that is removed at once, and the key in it is encrypted with a random password
    that only ever exists in memory: a crash between write and delete leaves nothing usable.
    """
    password = secrets.token_bytes(32)
    blob = cert_pem + _pkcs8(key, serialization.BestAvailableEncryption(password))
    with tempfile.TemporaryDirectory(prefix="deskfleet-tls-") as tmp:
        path = os.path.join(tmp, "chain.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        ctx.load_cert_chain(path, password=password)


class _RefusalLoggingSSLObject(ssl.SSLObject):
    """The server side of a fleet TLS connection, logging why a handshake was refused: asyncio
    drops a failed server handshake without a word (unless the loop runs in debug mode), so a
    stranger knocking on a port would otherwise leave no trace. Each reason is logged once at
    WARNING per server context, then at DEBUG."""

    _warned: set[str]
    _server: str
    _admit: frozenset[Role]
    _refuse: PeerRefusal | None

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as exc:
            reason = str(getattr(exc, "reason", None) or type(exc).__name__)
            if isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError):
                log.debug("%s: a client left during the TLS handshake (%s)", self._server, exc)
            else:
                self._log_once(reason, f"{TLS_REFUSALS.get(reason, 'the TLS handshake failed')} ({reason}); "
                                       "only members of this fleet may connect")
            raise
        der = self.getpeercert(binary_form=True)
        if not der:
            return  # no certificate asked for (enrollment): nothing to refuse by role
        role = peer_role(der)
        refusal = refuse_role(role, self._admit)
        if refusal is not None:
            self._log_once(f"role:{role}", refusal)
            raise PeerRoleRefused(refusal)
        refusal = self._refuse(der) if self._refuse is not None else None
        if refusal is not None:
            self._log_once(f"refused:{peer_node_id(der)}", refusal)
            raise PeerRefused(refusal)

    def _log_once(self, key: str, why: str) -> None:
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, "%s refused a TLS connection: %s", self._server, why)


@dataclass(frozen=True)
class Credentials:
    """A fleet member's identity: the fleet CA, its certificate, and its key (all PEM).

    Checked on construction (parseable, key matches certificate, certificate signed by the CA)
    so that damaged keyring contents fail here, with a message, not in a TLS handshake later.
    Expiry is not checked here: expired credentials must still load so the agent can say so.
    """

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    def __post_init__(self) -> None:
        ca = _load_cert(self.ca_pem, "fleet CA certificate")
        cert = _load_cert(self.cert_pem, "certificate")
        key = _load_key(self.key_pem)
        if not _owns(key, cert):
            raise CredentialsError("the private key does not belong to the certificate; "
                                   "the stored credentials are mixed up: leave the fleet and join again")
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise CredentialsError("the certificate was not issued by the stored fleet CA; "
                                   "leave the fleet and join again") from exc

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def node_id(self) -> str:
        """sha256 (hex) of the certificate's DER: this member's id throughout the fleet."""
        return peer_node_id(self.certificate.public_bytes(serialization.Encoding.DER))

    @property
    def ca_fingerprint(self) -> str:
        return ca_fingerprint(self.ca_pem)

    @property
    def fleet_id(self) -> str:
        return fleet_id_of(self.ca_fingerprint)

    @property
    def not_after(self) -> datetime.datetime:
        """When the certificate expires (UTC); the member must join again before then."""
        return self.certificate.not_valid_after_utc

    @property
    def name(self) -> str:
        attrs = self.certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return str(attrs[0].value) if attrs else ""

    @property
    def role(self) -> Role | None:
        return peer_role(self.certificate.public_bytes(serialization.Encoding.DER))

    def _context(self, purpose: ssl._SSLMethod) -> ssl.SSLContext:
        ctx = ssl.SSLContext(purpose)  # a bare context trusts nothing until told
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
        ctx.load_verify_locations(cadata=self.ca_pem.decode("ascii"))  # the fleet CA, nothing else
        _load_chain(ctx, self.cert_pem, _load_key(self.key_pem))
        return ctx

    def server_context(self, *, verify_clients: bool = True, admit: frozenset[Role] = MEMBER_ROLES,
                       refuse: PeerRefusal | None = None) -> ssl.SSLContext:
        """A TLS server context presenting this certificate that admits only clients with a
        certificate from this fleet's CA whose role is in ``admit``: members (agents and the
        service) by default, never an admin; the service's admin API passes ``ADMIN_ROLES``.
        A refused role ends the handshake (:class:`PeerRoleRefused`, logged once). ``verify_clients=False``
        is for the enrollment endpoint only, whose callers have no certificate yet and prove
        themselves with a token. ``refuse(der)`` is asked after the role check: a reason ends the
        handshake (:class:`PeerRefused`; the admin API's revoked admin certificates)."""
        ctx = self._context(ssl.PROTOCOL_TLS_SERVER)
        ctx.verify_mode = ssl.CERT_REQUIRED if verify_clients else ssl.CERT_NONE
        server = f"{self.name or 'this node'} ({self.role or 'member'})"
        ctx.sslobject_class = type("FleetServerSSLObject", (_RefusalLoggingSSLObject,),
                                   {"_warned": set(), "_server": server, "_admit": frozenset(admit),
                                    "_refuse": staticmethod(refuse) if refuse is not None else None})
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A TLS client context presenting this certificate that accepts only servers with a
        certificate from this fleet's CA."""
        ctx = self._context(ssl.PROTOCOL_TLS_CLIENT)
        # Members are dialled by IP address (DHCP office LANs) and their certificates name no
        # host, so there is no hostname to check: a peer's identity is the fleet CA's signature
        # plus its certificate fingerprint (node id), which callers compare to what they expect.
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def check_request(csr_pem: bytes | str) -> x509.CertificateSigningRequest:
    """Load a CSR and refuse it unless its self-signature verifies and its key is EC (P-256/384/521)
    or RSA (2048-8192 bits). Raises CertificateRequestError saying which."""
    if isinstance(csr_pem, str):
        csr_pem = csr_pem.encode("utf-8", "replace")
    if len(csr_pem) > MAX_CSR_BYTES:
        raise CertificateRequestError(f"the certificate request is {len(csr_pem)} bytes; at most "
                                      f"{MAX_CSR_BYTES} are accepted")
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
        key = csr.public_key()
        valid = csr.is_signature_valid
    except (ValueError, TypeError) as exc:
        raise CertificateRequestError(f"the certificate request is not a readable PEM CSR ({exc})") from exc
    if not valid:
        raise CertificateRequestError("the certificate request's signature does not verify: it was "
                                      "altered or not made with the key it carries")
    if isinstance(key, ec.EllipticCurvePublicKey):
        if key.curve.name not in EC_CURVES:
            raise CertificateRequestError(f"the request's EC curve {key.curve.name} is not accepted; "
                                          f"use one of {', '.join(sorted(EC_CURVES))}")
    elif isinstance(key, rsa.RSAPublicKey):
        if key.key_size not in RSA_BITS:
            raise CertificateRequestError(f"the request's RSA key has {key.key_size} bits; "
                                          f"{RSA_BITS.start}-{RSA_BITS.stop - 1} are accepted")
    else:
        raise CertificateRequestError(f"the request's key is a {type(key).__name__}; "
                                      "only EC and RSA keys are accepted")
    return csr


def make_key_and_csr(name: str) -> tuple[bytes, bytes]:
    """A new EC P-256 key and a CSR for it naming ``name`` (both PEM). The key stays with the
    caller; only the CSR travels to the console."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, sanitize_name(name))]))
           .sign(key, hashes.SHA256()))
    return _pkcs8(key), csr.public_bytes(serialization.Encoding.PEM)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class FleetAuthority:
    """The fleet's CA: the console's certificate and key that every member's certificate chains to."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
        self._cert = cert
        self._key = key

    @classmethod
    def create(cls, name: str, *, days: int = CA_DAYS, now: datetime.datetime | None = None) -> FleetAuthority:
        """A new self-signed CA (EC P-256, path length 0: it signs members, never other CAs)."""
        now = now or _utcnow()
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANISATION),
                             x509.NameAttribute(NameOID.COMMON_NAME, sanitize_name(f"{name} fleet CA"))])
        cert = (x509.CertificateBuilder()
                .subject_name(subject).issuer_name(subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - CLOCK_SKEW)
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=True, crl_sign=True,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert, key)

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes, *, password: bytes | None = None) -> FleetAuthority:
        """The CA from its stored certificate and key (encrypted under ``password`` if given);
        CredentialsError if the key does not decrypt, they do not belong together, or the
        certificate is not a CA."""
        cert, key = _load_cert(cert_pem, "fleet CA certificate"), _load_key(key_pem, password)
        if not _owns(key, cert):
            raise CredentialsError("the fleet CA key does not belong to the fleet CA certificate")
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise CredentialsError("the certificate given as the fleet CA is not a CA certificate")
        return cls(cert, key)

    @property
    def ca_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        """The CA key, unencrypted PKCS#8 PEM: for tests and in-memory use; on disk it is
        :meth:`encrypted_key_pem`."""
        return _pkcs8(self._key)

    def encrypted_key_pem(self, password: bytes) -> bytes:
        """The CA key as encrypted PKCS#8 PEM (the best scheme ``cryptography`` offers), to rest on disk."""
        return _pkcs8(self._key, serialization.BestAvailableEncryption(password))

    @property
    def fingerprint(self) -> str:
        return sha256_hex(self._cert.public_bytes(serialization.Encoding.DER))

    @property
    def fleet_id(self) -> str:
        return fleet_id_of(self.fingerprint)

    def sign_request(self, csr_pem: bytes | str, *, role: Role, days: int = LEAF_DAYS, name: str | None = None,
                     now: datetime.datetime | None = None) -> bytes:
        """Sign a member certificate (PEM) for a CSR that passes :func:`check_request`.

        Only the CSR's key and name are used; any extensions it asks for are ignored, so a
        request cannot make itself a CA. The CN is ``name`` (default: the CSR's CN), sanitised;
        the role goes in the OU. EKU is serverAuth + clientAuth because an agent both dials and
        listens. Validity is cut at the CA's own expiry.
        """
        if not 1 <= days <= CA_DAYS:
            raise ValueError(f"days must be between 1 and {CA_DAYS}, got {days}")
        csr = check_request(csr_pem)
        if name is None:
            cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            name = str(cns[0].value) if cns else ""
        now = now or _utcnow()
        not_after = min(now + datetime.timedelta(days=days), self._cert.not_valid_after_utc)
        key = csr.public_key()
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANISATION),
                             x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, Role(role).value),
                             x509.NameAttribute(NameOID.COMMON_NAME, sanitize_name(name))])
        ca_ski = self._cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (x509.CertificateBuilder()
                .subject_name(subject).issuer_name(self._cert.subject)
                .public_key(key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - CLOCK_SKEW)
                .not_valid_after(not_after)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=isinstance(key, rsa.RSAPublicKey),
                                             data_encipherment=False, key_agreement=False,
                                             key_cert_sign=False, crl_sign=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM)

    def issue_credentials(self, name: str, *, role: Role, days: int = LEAF_DAYS) -> Credentials:
        """Fresh member credentials signed here (for the console itself, or for tests). ``role``
        has no default: a forgotten one must not quietly mint a console."""
        key_pem, csr_pem = make_key_and_csr(name)
        return Credentials(self.ca_pem, self.sign_request(csr_pem, role=role, days=days), key_pem)

    def issue_admin(self, name: str, *, days: int = ADMIN_DAYS) -> Credentials:
        """Credentials for a person who administers the fleet from a console on another PC: an
        ``ADMIN`` certificate that the service's admin API accepts and no agent or stage does.
        ``deskfleet fleet admin-cert`` writes them with :mod:`engine.trust.admin_bundle`. At most
        MAX_ADMIN_DAYS: CredentialsError beyond."""
        if not 1 <= days <= MAX_ADMIN_DAYS:
            raise CredentialsError(f"an admin certificate lives 1 to {MAX_ADMIN_DAYS} days, not {days}: a short life "
                                   "bounds what a lost or forgotten one can do; issue a new one before it expires")
        return self.issue_credentials(name, role=Role.ADMIN, days=days)
