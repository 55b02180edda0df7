"""The admin certificates of a fleet: every one issued (or first seen) is recorded, and can be revoked.

An admin certificate controls the whole fleet (join tokens, the console's API key, models), and
its key rests unencrypted in the admin's folder. So a lost laptop must be cut off without a new CA:
the ``admin_certs`` table of the service's state database (hashes and names only) keeps, per
certificate fingerprint (sha256 of its DER, as ``engine.trust.fleet_ca.peer_node_id``), its name,
issue and expiry times and, once revoked, when. The admin API refuses a revoked certificate at
the TLS handshake and again on every request (a connection kept alive across the revocation).

``deskfleet fleet admin-cert NAME`` records what it issues; a certificate issued before records
existed is recorded the first time it is used, so it shows in ``--list`` and can be revoked like
the others. The CLI and the running service share the database (a change is a transaction); the
service reads the table at each handshake, so a revocation from a shell holds from the next one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from pathlib import Path
from typing import Any

from console.fleet.errors import FleetStateError
from console.fleet.fleet_state import fleet_db, state_errors
from console.fleet_api.errors import FleetServiceError
from engine.errors import DeskfleetError
from engine.trust.fleet_ca import peer_node_id

MAX_RECORDS = 4096  # an office's admins over years; beyond that the oldest expired ones go
_WHAT = "the admin-certificate list"
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


class AdminCertError(DeskfleetError):
    """An admin-certificate action cannot be done: an unknown fingerprint or name, an ambiguous one,
    (the message says what to do)."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _describe(der: bytes) -> dict[str, str]:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_der_x509_certificate(der)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return {"name": str(names[0].value) if names else "?",
            "not_after": cert.not_valid_after_utc.isoformat(timespec="seconds")}


class AdminCertBook:
    """The admin-certificate records in the state database of ``state_dir`` (see the module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)

    @property
    def path(self) -> Path:
        return fleet_db(self.state_dir).path

    # -- reading ------------------------------------------------------------------------------------

    def certs(self) -> dict[str, dict[str, Any]]:
        """fingerprint -> record, as the database holds them now."""
        with state_errors():
            return fleet_db(self.state_dir).admin_certs()

    def listing(self) -> list[dict[str, Any]]:
        """Every record, oldest first, with its fingerprint and state (active / expired / revoked)."""
        now = _now()
        rows = [{"fingerprint": fp, **rec,
                 "state": "revoked" if rec.get("revoked_at") else "expired" if rec["not_after"] < now else "active"}
                for fp, rec in self.certs().items()]
        return sorted(rows, key=lambda r: (r.get("issued_at") or "", r["fingerprint"]))

    def refusal(self, der: bytes) -> str | None:
        """Why the admin API must refuse this admin certificate (DER), or None. A certificate not
        recorded yet (issued before records existed) is recorded now and let in."""
        fingerprint = peer_node_id(der)
        try:
            record = self.certs().get(fingerprint)
        except FleetStateError as exc:
            return f"the admin-certificate list cannot be read ({exc})"  # fail closed
        if record is None:
            with contextlib.suppress(FleetStateError):
                self.record(der, source="first seen")
            return None
        if record.get("revoked_at"):
            return (f"the admin certificate {fingerprint[:16]} ({record.get('name')}) was revoked at "
                    f"{record['revoked_at']}; ask another admin for a new one")
        return None

    # -- changing -----------------------------------------------------------------------------------

    def record(self, der: bytes, *, source: str = "issued") -> dict[str, Any]:
        """Record a certificate (DER) as issued now (``source``: how we learnt of it); idempotent."""
        fingerprint = peer_node_id(der)
        with state_errors():
            db = fleet_db(self.state_dir)
            with db.transaction():
                certs = db.admin_certs()
                if fingerprint not in certs:
                    certs[fingerprint] = {**_describe(der), "issued_at": _now(), "source": source, "revoked_at": None}
                    db.put_admin_cert(fingerprint, certs[fingerprint])
                    for fp in _pruned(certs):
                        db.delete_admin_cert(fp)
                return {"fingerprint": fingerprint, **certs[fingerprint]}

    def revoke(self, which: str) -> dict[str, Any]:
        """Revoke the certificate named by ``which``: its fingerprint (or a unique start of it, at
        least 8 hex digits) or the name of exactly one live certificate. Revoking twice is a no-op."""
        with state_errors():
            db = fleet_db(self.state_dir)
            with db.transaction():
                certs = db.admin_certs()
                fingerprint = _find(certs, which)
                if not certs[fingerprint].get("revoked_at"):
                    certs[fingerprint] = {**certs[fingerprint], "revoked_at": _now()}
                    db.put_admin_cert(fingerprint, certs[fingerprint])
                return {"fingerprint": fingerprint, **certs[fingerprint]}


def _find(certs: dict[str, dict[str, Any]], which: str) -> str:
    which = which.strip().lower().replace(":", "")
    if _FINGERPRINT.fullmatch(which) and which in certs:
        return which
    if re.fullmatch(r"[0-9a-f]{8,64}", which):
        matches = [fp for fp in certs if fp.startswith(which)]
    else:
        matches = [fp for fp, rec in certs.items() if str(rec.get("name", "")).lower() == which
                   and not rec.get("revoked_at")]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise AdminCertError(f"no recorded admin certificate is {which!r}; `deskfleet fleet admin-cert --list` "
                             "shows their fingerprints and names")
    raise AdminCertError(f"{which!r} names {len(matches)} admin certificates; give its fingerprint (from "
                         "`deskfleet fleet admin-cert --list`)")


def _pruned(certs: dict[str, dict[str, Any]]) -> list[str]:
    """The records to drop to keep at most MAX_RECORDS: the longest-expired first (a revoked one
    only once expired)."""
    if len(certs) <= MAX_RECORDS:
        return []
    now = _now()
    expired = sorted((rec["not_after"], fp) for fp, rec in certs.items() if rec["not_after"] < now)
    return [fp for _, fp in expired[:len(certs) - MAX_RECORDS]]



def issue_admin_pems(state_dir: Path, name: str, days: int) -> dict[str, str]:
    """A new admin certificate from the fleet CA in ``state_dir``: its PEMs (ca, cert, key). Runs as
    the state dir's owner under ``sudo`` (engine.trust.state_owner), not confined: the CA's wrapping
    key is in the keyring named after the state dir's path."""
    from engine.control.fleet_services import load_or_create_authority
    from engine.trust.keystore import ConsoleSecrets

    authority = load_or_create_authority(state_dir, secrets_=ConsoleSecrets(state_dir))
    creds = authority.issue_admin(name, days=days)
    return {"ca_pem": creds.ca_pem.decode("ascii"), "cert_pem": creds.cert_pem.decode("ascii"),
            "key_pem": creds.key_pem.decode("ascii")}


def record_pem(state_dir: Path, cert_pem: str) -> dict[str, Any]:
    """Record the admin certificate ``cert_pem`` as issued now in ``state_dir``'s state database."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    der = x509.load_pem_x509_certificate(cert_pem.encode("ascii")).public_bytes(Encoding.DER)
    return AdminCertBook(state_dir).record(der)


def issue_recorded(state_dir: Path, name: str, days: int) -> dict[str, str]:
    """A new admin certificate from the fleet CA in ``state_dir``, recorded there: its PEMs (ca, cert,
    key) and fingerprint (in this process)."""
    issued = issue_admin_pems(state_dir, name, days)
    return {**issued, "fingerprint": record_pem(state_dir, issued["cert_pem"])["fingerprint"]}


def write_admin_certificate(state_dir: Path, name: str, out: Path, *, days: int = 365) -> Path:
    """Issue an admin certificate from the fleet CA in ``state_dir``, record it there (as the state
    dir's owner under sudo: console.fleet.admin_certs) and write it to ``out``."""
    from engine.control.fleet_services import is_first_run
    from engine.trust.admin_bundle import write_admin_credentials
    from engine.trust.fleet_ca import Credentials
    from engine.trust.state_owner import run_as_owner

    if is_first_run(state_dir):
        raise FleetServiceError(f"there is no fleet in {state_dir} (no fleet CA); start `deskfleet fleet` there first, "
                           "or pass the service's --state-dir")
    _preload_for_owner()
    issued = run_as_owner(state_dir, lambda where: issue_admin_pems(where, name, days), confine=False)
    run_as_owner(state_dir, lambda where: record_pem(where, issued["cert_pem"]))
    creds = Credentials(issued["ca_pem"].encode(), issued["cert_pem"].encode(), issued["key_pem"].encode())
    return write_admin_credentials(creds, out)


def _preload_for_owner() -> None:
    """Import (and choose the keyring backend) before a child drops to the state dir's owner, who may
    not be allowed to read root's Python installation or keyring settings."""
    import keyring
    from cryptography.hazmat.backends import default_backend
    from cryptography.hazmat.primitives.asymmetric import ec

    import engine.control.fleet_services  # noqa: F401 - imported for the child
    import engine.trust.keystore  # noqa: F401 - imported for the child

    default_backend()
    ec.generate_private_key(ec.SECP256R1())  # loads what signing and key serialisation need
    keyring.get_keyring()
