"""Fleet credentials kept in the OS keyring, with a file stand-in where there is none.

Each :class:`KeyStore` account (one per agent state directory, so several agents on one PC do
not collide) holds three entries under the service ``deskfleet``: ``<account>/ca``,
``<account>/cert`` and ``<account>/key``, each the base64 of DER. Three small entries rather
than one blob because Windows Credential Manager caps a secret at 2560 bytes (UTF-16), and
base64 of DER because it is compact and has no newlines for a backend to mangle.

Headless Linux has no OS keyring (keyring's choice there is its ``fail`` backend); only then is
:class:`FileKeyring` used, a 0600 JSON file, protected like an SSH key is: by file permissions.

The console keeps its own secrets here too (:class:`ConsoleSecrets`): the key its fleet CA key
is encrypted under, and the API key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import keyring
import keyring.backend
import keyring.backends.fail
import keyring.errors
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from keyring.compat import properties

from engine.atomic_file import write_json_atomic
from engine.envvars import KEYRING_DIR
from engine.errors import CredentialsError, KeyStoreError
from engine.trust.fleet_ca import Credentials

SERVICE = "deskfleet"
PARTS = ("ca", "cert", "key")
FILE_NAME = "keyring.json"


def default_keyring_dir() -> Path:
    """``$DESKFLEET_KEYRING_DIR``, else ``$XDG_DATA_HOME/deskfleet`` (``~/.local/share/deskfleet``)."""
    if os.environ.get(KEYRING_DIR):
        return Path(os.environ[KEYRING_DIR])
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "deskfleet"


class FileKeyring(keyring.backend.KeyringBackend):
    """A keyring backend storing secrets in ``<directory>/keyring.json`` (mode 0600, dir 0700).

    Not offered to keyring's own discovery (``priority`` raises), so importing this module
    never changes what other programs' ``keyring.get_keyring()`` returns; :class:`KeyStore`
    picks it explicitly, and tests construct it on a temp directory.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.path = Path(directory if directory is not None else default_keyring_dir()) / FILE_NAME

    @properties.classproperty
    def priority(cls) -> float:
        raise RuntimeError("FileKeyring is chosen by deskfleet.keystore, never by keyring discovery")

    def __str__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__} ({self.path})"

    def get_password(self, service: str, username: str) -> str | None:
        return self._read().get(service, {}).get(username)

    def set_password(self, service: str, username: str, password: str) -> None:
        data = self._read()
        data.setdefault(service, {})[username] = password
        self._write(data)

    def delete_password(self, service: str, username: str) -> None:
        data = self._read()
        if username not in data.get(service, {}):
            raise keyring.errors.PasswordDeleteError(f"no secret {service}/{username} in {self.path}")
        del data[service][username]
        if not data[service]:
            del data[service]
        self._write(data)

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise keyring.errors.KeyringError(f"the file keyring {self.path} is unreadable ({exc}); "
                                              "move it aside and join the fleet again") from exc
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise keyring.errors.KeyringError(f"the file keyring {self.path} is not a keyring file; "
                                              "move it aside and join the fleet again")
        return data

    def _write(self, data: dict[str, dict[str, str]]) -> None:
        """Replace the file atomically (temp + ``os.replace``): a crash leaves the old or the new."""
        try:
            write_json_atomic(self.path, data, indent=1, sort_keys=True, dir_mode=0o700)
        except OSError as exc:
            raise keyring.errors.KeyringError(f"cannot write the file keyring {self.path} ({exc}); "
                                              "check the disk and the directory's permissions") from exc


def default_backend() -> keyring.backend.KeyringBackend:
    """The OS keyring, or a :class:`FileKeyring` when keyring found none (its ``fail`` backend)."""
    backend = keyring.get_keyring()
    if isinstance(backend, keyring.backends.fail.Keyring):
        return FileKeyring()
    return backend


def console_backend(state_dir: Path) -> keyring.backend.KeyringBackend:
    """Where the console keeps its own secrets: the OS keyring; without one, a :class:`FileKeyring`
    in ``$DESKFLEET_KEYRING_DIR`` if set (e.g. on another disk than the state), else in the
    console's own (0700) state directory, protected by file permissions only."""
    backend = default_backend()
    if isinstance(backend, FileKeyring) and not os.environ.get(KEYRING_DIR):
        return FileKeyring(state_dir)
    return backend


class ConsoleSecrets:
    """The console's own secrets (the fleet CA key's wrapping key, the API key), one keyring
    entry each under the account ``console-<sha256 of the state directory>``: two consoles on
    one PC with different state directories keep different secrets."""

    def __init__(self, state_dir: Path, *, backend: keyring.backend.KeyringBackend | None = None) -> None:
        state_dir = Path(state_dir)
        self.account = "console-" + hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:16]
        self.backend = backend if backend is not None else console_backend(state_dir)

    def get(self, name: str) -> str | None:
        """The secret ``name``, or None if the keyring holds none. KeyStoreError if it cannot be read."""
        try:
            return self.backend.get_password(SERVICE, f"{self.account}/{name}")
        except keyring.errors.KeyringError as exc:
            raise KeyStoreError(f"the keyring ({self.backend}) could not be read ({exc}); "
                                "unlock the keyring and start the console again") from exc

    def put(self, name: str, value: str) -> None:
        """Store the secret ``name``, replacing what was there. KeyStoreError if refused."""
        try:
            self.backend.set_password(SERVICE, f"{self.account}/{name}", value)
        except keyring.errors.KeyringError as exc:
            raise KeyStoreError(f"the keyring ({self.backend}) refused to store the console's {name} "
                                f"({exc}); unlock the keyring and start the console again") from exc

    def get_or_create(self, name: str, make: Callable[[], str]) -> str:
        """The secret ``name``; ``make()`` stored under it the first time."""
        value = self.get(name)
        if value is None:
            value = make()
            self.put(name, value)
        return value


def _encode(part: str, pem: bytes) -> str:
    if part == "key":
        key = serialization.load_pem_private_key(pem, password=None)
        der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    else:
        der = x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
    return base64.b64encode(der).decode("ascii")


def _decode(part: str, text: str) -> bytes:
    der = base64.b64decode(text.encode("ascii"), validate=True)
    if part == "key":
        key = serialization.load_der_private_key(der, password=None)
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


class KeyStore:
    """One agent's (or the console's) fleet credentials in the keyring, under ``account``."""

    def __init__(self, account: str, *, backend: keyring.backend.KeyringBackend | None = None) -> None:
        if not account or "/" in account:
            raise ValueError(f"a keystore account must be non-empty and contain no '/', got {account!r}")
        self.account = account
        self.backend = backend if backend is not None else default_backend()

    def _username(self, part: str) -> str:
        return f"{self.account}/{part}"

    def save(self, creds: Credentials) -> None:
        """Store ``creds``, replacing what the account held."""
        values = {"ca": creds.ca_pem, "cert": creds.cert_pem, "key": creds.key_pem}
        try:
            for part in PARTS:
                self.backend.set_password(SERVICE, self._username(part), _encode(part, values[part]))
        except keyring.errors.KeyringError as exc:
            raise KeyStoreError(f"the keyring ({self.backend}) refused to store the fleet credentials "
                                f"({exc}); unlock the keyring and try again") from exc

    def load(self) -> Credentials | None:
        """The stored credentials, or None if the account holds none (never joined, or left).

        Raises KeyStoreError if the keyring fails or holds only part of them, and
        CredentialsError if what it holds does not decode to consistent credentials.
        """
        try:
            texts = {p: self.backend.get_password(SERVICE, self._username(p)) for p in PARTS}
        except keyring.errors.KeyringError as exc:
            raise KeyStoreError(f"the keyring ({self.backend}) could not be read ({exc}); "
                                "unlock the keyring and try again") from exc
        missing = [p for p, t in texts.items() if t is None]
        if len(missing) == len(PARTS):
            return None
        if missing:
            raise KeyStoreError(f"the keyring holds only part of the fleet credentials for {self.account} "
                                f"(missing: {', '.join(missing)}); leave the fleet and join again")
        try:
            pems = {p: _decode(p, t) for p, t in texts.items() if t is not None}  # none missing here
        except (ValueError, TypeError, binascii.Error) as exc:
            raise CredentialsError(f"the fleet credentials stored for {self.account} are damaged ({exc}); "
                                   "leave the fleet and join again") from exc
        return Credentials(pems["ca"], pems["cert"], pems["key"])

    def delete(self) -> None:
        """Remove the account's credentials (leaving the fleet); a no-op if there are none."""
        for part in PARTS:
            try:
                self.backend.delete_password(SERVICE, self._username(part))
            except keyring.errors.PasswordDeleteError:
                pass  # already gone: deleting is idempotent
            except keyring.errors.KeyringError as exc:
                raise KeyStoreError(f"the keyring ({self.backend}) refused to delete the fleet credentials "
                                    f"({exc}); unlock the keyring and try again") from exc
