"""An admin's credentials on disk: what `deskfleet fleet admin-cert NAME --out DIR` writes on the
service's PC and `deskfleet console --admin-cert DIR` reads on the admin's (no sockets, no Qt).

The folder holds three PEM files (docs/ADMIN_API.md)::

    admin.crt      the admin's certificate (role admin, signed by the fleet CA)
    admin.key      its private key, unencrypted, mode 0600: the folder is the admin's login,
                   kept like an SSH key
    fleet-ca.crt   the fleet CA: the only anchor the console trusts the service's certificate by

Only the service's admin API admits the admin role
(:meth:`engine.trust.fleet_ca.FleetAuthority.issue_admin`); agents and stages refuse it.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.atomic_file import write_bytes_atomic
from engine.errors import CredentialsError, TrustError
from engine.trust.fleet_ca import Credentials, Role

CERT_FILE, KEY_FILE, CA_FILE = "admin.crt", "admin.key", "fleet-ca.crt"
MAX_BYTES = 64 << 10


class AdminCredentialsError(TrustError):
    """An admin credentials folder is missing a file, unreadable, or holds credentials that are not
    an admin's of one fleet (the message names the folder and what to do)."""


def write_admin_credentials(creds: Credentials, out_dir: Path) -> Path:
    """Write an admin's credentials into ``out_dir`` (created 0700 if missing; each file written
    atomically, the key 0600). Refuses credentials of another role: the folder must never carry
    the service's or an agent's key."""
    if creds.role is not Role.ADMIN:
        raise AdminCredentialsError(f"refusing to write a certificate of the {creds.role or 'no'} role as an admin's; "
                                    "issue one with FleetAuthority.issue_admin")
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_bytes_atomic(out / KEY_FILE, creds.key_pem)
    write_bytes_atomic(out / CERT_FILE, creds.cert_pem)
    write_bytes_atomic(out / CA_FILE, creds.ca_pem)
    for name in (CERT_FILE, CA_FILE):  # public halves: readable, the key stays 0600
        os.chmod(out / name, 0o644)
    return out


def read_admin_credentials(folder: Path) -> Credentials:
    """The admin credentials in ``folder``; AdminCredentialsError saying what is wrong otherwise
    (a missing file, a damaged one, a key of another certificate, a certificate of another role)."""
    folder = Path(folder)
    pems = []
    for name in (CA_FILE, CERT_FILE, KEY_FILE):
        try:
            with open(folder / name, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except OSError as exc:
            raise AdminCredentialsError(f"cannot read {folder / name} ({exc.strerror or exc}); the admin "
                                        f"folder holds {CERT_FILE}, {KEY_FILE} and {CA_FILE} as written by "
                                        "`deskfleet fleet admin-cert NAME --out DIR`") from exc
        if len(data) > MAX_BYTES:
            raise AdminCredentialsError(f"{folder / name} is larger than {MAX_BYTES} bytes: not a PEM file")
        pems.append(data)
    try:
        creds = Credentials(*pems)
    except CredentialsError as exc:
        raise AdminCredentialsError(f"the admin credentials in {folder}: {exc}") from exc
    if creds.role is not Role.ADMIN:
        raise AdminCredentialsError(f"{folder / CERT_FILE} has the {creds.role or 'no'} role, not admin; issue an "
                                    "admin certificate with `deskfleet fleet admin-cert NAME --out DIR`")
    return creds
