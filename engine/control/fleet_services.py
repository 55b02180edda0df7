"""The console's headless services in one place: the fleet CA (created on first run and kept
in the console's state dir), join tokens, the enrollment endpoint for joining PCs, and the hub
that serves shards and takes agents' registrations and events.

The Qt console hosts one of these; tests and benchmarks stand one up on loopback the same way.
With ``advertise_on`` the enrollment address is also advertised over mDNS
(:mod:`engine.discovery.join_service`), so a joining PC needs only the token.

At rest: the state directory is 0700 (tightened if it was not); the CA key file is 0600,
encrypted PKCS#8 under a random wrapping key kept in the keyring (:class:`ConsoleSecrets`: the
OS keyring, or without one a 0600 ``keyring.json`` in ``$DESKFLEET_KEYRING_DIR`` or else in the
state directory itself; then the key file alone, as a backup might copy it, is useless, but a
copy of the whole directory is not).

API keys are the fleet's key book (:class:`~engine.trust.key_book.KeyBook`, ``api-keys.json``:
names and hashes only). The console's own chat key is the key named ``console``: generated on the
first run, its secret kept in the keyring beside the wrapping key (the console's chat needs it
back), its hash in the book. Each joining PC is issued a key for its tray's chat
(``tray-<name>-<node id prefix>``, :meth:`FleetHost.issue_member_key`) with its certificate;
removing the PC revokes it (:meth:`FleetHost.revoke_member_keys`).

For the console's lifetime an exclusive lock on ``console.lock`` keeps a second console off the
same state (two would lose each other's token book updates).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import ssl
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engine import __version__
from engine.atomic_file import write_bytes_atomic
from engine.control.enrollment import EnrollmentServer, load_or_create_console_credentials
from engine.control.hub import FleetHub
from engine.control.join_audit import JoinAudit
from engine.discovery.join_service import ConsoleAdvertiser, console_advertisement
from engine.errors import CredentialsError, DeskfleetError
from engine.trust.fleet_ca import Credentials, FleetAuthority
from engine.trust.join_token import TokenBook
from engine.trust.key_book import CONSOLE_KEY_NAME, KEY_PREFIX, KeyBook, new_secret, sanitize_key_name
from engine.trust.keystore import ConsoleSecrets

CA_CERT = "fleet-ca.crt"
CA_KEY = "fleet-ca.key"
LOCK_FILE = "console.lock"
WRAP_SECRET = "ca-key-wrap"  # ConsoleSecrets name of the CA key's wrapping key
API_KEY_SECRET = "api-key"  # ConsoleSecrets name of the console key's secret
# Members get a key of their own in assignments, never the console's (issue 29, M9): limited like a
# person's chat, named for the member (audited as it), revoked with it. The console key every member
# held before is rotated once, at the first start that marks it so in the state dir.
MEMBER_KEY_RPM = 60
MEMBER_KEY_TPM = 60_000
CONSOLE_KEY_MEMBER_SAFE = "console-key-member-safe"  # marker: the console key is one no member ever got
API_KEY_PREFIX = KEY_PREFIX
log = logging.getLogger(__name__)
HOLDER_OFFSET = 16  # the lock holder's description starts past the (Windows) locked byte


class StateDirLockedError(DeskfleetError):
    """Raised when a console starts on a state directory another running console holds."""


def prepare_state_dir(state_dir: Path) -> None:
    """Create ``state_dir`` 0700, or tighten it to 0700: it holds the fleet's keys."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.name == "posix":
        os.chmod(state_dir, 0o700)


def write_token_file(path: Path, token: str) -> Path:
    """``token`` in a new 0600 file at ``path`` (its folder made if missing), for an agent's
    ``--join-file``: a join token never goes on a command line. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, token.encode())
    return path


def _lock(fd: int) -> None:
    if sys.platform == "win32":  # the form type checkers narrow on
        import msvcrt  # Windows only

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    else:
        import fcntl  # POSIX only

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


@contextlib.contextmanager
def state_dir_lock(state_dir: Path) -> Iterator[None]:
    """Hold ``state_dir``'s console lock until the block exits; StateDirLockedError naming the
    process that holds it otherwise. The OS drops the lock when the process dies, so a crashed
    console never leaves a stale one."""
    path = state_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            _lock(fd)
        except OSError:
            os.lseek(fd, HOLDER_OFFSET, os.SEEK_SET)
            holder = os.read(fd, 512).decode("utf-8", "replace").strip() or "a process that did not say which"
            raise StateDirLockedError(f"another Deskfleet console is using {state_dir} ({holder}); close it "
                                      "first, or give this console its own --state-dir") from None
        os.ftruncate(fd, HOLDER_OFFSET)
        os.lseek(fd, HOLDER_OFFSET, os.SEEK_SET)
        os.write(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode("utf-8", "replace"))
        yield
    finally:
        os.close(fd)  # releases the lock


def is_first_run(state_dir: Path) -> bool:
    """Whether the console in ``state_dir`` has no fleet CA yet (the next start creates one)."""
    return not ((state_dir / CA_CERT).exists() and (state_dir / CA_KEY).exists())


def _new_wrapping_key() -> str:
    return secrets.token_urlsafe(32)


def load_or_create_authority(state_dir: Path, name: str = "Deskfleet fleet", *,
                             secrets_: ConsoleSecrets | None = None) -> FleetAuthority:
    """The fleet CA in ``state_dir``; a new one the first time. The key file is encrypted under
    the wrapping key in ``secrets_`` (see the module docstring); a plaintext key left by an older
    console is encrypted on the way in, and any key file is tightened to 0600."""
    prepare_state_dir(state_dir)
    store = secrets_ or ConsoleSecrets(state_dir)
    cert, key = state_dir / CA_CERT, state_dir / CA_KEY
    if cert.exists() and key.exists():
        if os.name == "posix":
            os.chmod(key, 0o600)
        key_pem = key.read_bytes()
        if b"ENCRYPTED" not in key_pem:  # an older console's plaintext key: encrypt it now
            authority = FleetAuthority.from_pem(cert.read_bytes(), key_pem)
            wrap = store.get_or_create(WRAP_SECRET, _new_wrapping_key)
            write_bytes_atomic(key, authority.encrypted_key_pem(wrap.encode()))
            return authority
        kept = store.get(WRAP_SECRET)
        if kept is None:
            raise CredentialsError(f"the fleet CA key in {key} is encrypted, and the key it is encrypted under "
                                   f"is not in the keyring ({store.backend}); restore that keyring (or its "
                                   "keyring.json), or start a new fleet in an empty --state-dir")
        return FleetAuthority.from_pem(cert.read_bytes(), key_pem, password=kept.encode())
    authority = FleetAuthority.create(name)
    wrap = _new_wrapping_key()
    store.put(WRAP_SECRET, wrap)  # first: a key file whose wrapping key was never kept is useless
    write_bytes_atomic(key, authority.encrypted_key_pem(wrap.encode()))
    cert.write_bytes(authority.ca_pem)
    return authority


def load_or_create_api_key(state_dir: Path, *, secrets_: ConsoleSecrets | None = None,
                           book: KeyBook | None = None) -> str:
    """The console's own API key (its chat sends it as ``Authorization: Bearer``), generated the
    first time (192 bits) and kept in the keyring beside the CA's wrapping key; recorded in the
    fleet's key book (``book``, default the state dir's) as the key named ``console``."""
    store = secrets_ or ConsoleSecrets(state_dir)
    marker = state_dir / CONSOLE_KEY_MEMBER_SAFE
    older = None if marker.exists() else store.get(API_KEY_SECRET)
    key = store.get_or_create(API_KEY_SECRET, new_secret)
    if not marker.exists():  # an older version's key went to every ring member: retire it, once
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if older is None:  # a new fleet: its first key never left
            marker.write_text("the console API key never went to a member\n")
            (book or KeyBook(state_dir)).adopt(CONSOLE_KEY_NAME, key)
            return key
        key = new_secret()
        store.put(API_KEY_SECRET, key)
        (book or KeyBook(state_dir)).adopt(CONSOLE_KEY_NAME, key)
        marker.write_text("the console API key was rotated once after members stopped receiving it\n")
        log.warning("the console's API key was rotated once: older versions sent it to every ring member, "
                    "which now get keys of their own")
        return key
    (book or KeyBook(state_dir)).adopt(CONSOLE_KEY_NAME, key)
    return key


def assignment_key_name(node_id: str) -> str:
    """The name of the member-scoped key member ``node_id``'s assignments carry."""
    return f"member-{node_id[:16]}"


def member_key_name(node_id: str, name: str) -> str:
    """The key name of member ``node_id``'s tray chat: ``tray-<its name, made a key name>-<8 hex>``."""
    return f"tray-{sanitize_key_name(name)[:40]}-{node_id[:8]}"


def issue_member_key(keys: KeyBook, node_id: str, name: str) -> str:
    """Issue (or re-issue: a PC joining again) member ``node_id``'s tray key; its secret."""
    return keys.issue(member_key_name(node_id, name), node_id=node_id, replace_live=True).secret


@dataclass
class FleetHost:
    authority: FleetAuthority
    credentials: Credentials  # the console's own fleet certificate (role console)
    tokens: TokenBook
    enrollment: str  # HOST:PORT where PCs redeem join tokens
    hub: FleetHub
    api_key: str = field(default="", repr=False)  # the console's own API key (the key named "console")
    secrets_store: ConsoleSecrets | None = field(default=None, repr=False)  # where api_key is kept
    keys: KeyBook | None = field(default=None, repr=False)  # the fleet's API keys; the API checks requests in it
    key_rotated: bool = False  # a removal replaced the key this run: it wins over one given on the command line
    _key_listeners: list[Callable[[str], None]] = field(default_factory=list, repr=False)
    audit: JoinAudit | None = field(default=None, repr=False)  # the enrolment audit (enrolment-audit.jsonl)
    member_keys: dict[str, str] = field(default_factory=dict, repr=False)  # node id -> its assignment key (this run)
    # told (node id, name) of every PC admitted, after its certificate is signed and the book noted the token
    join_listeners: list[Callable[[str, str], None]] = field(default_factory=list, repr=False)

    def token(self, ttl_s: float = 24 * 3600) -> str:
        return self.tokens.issue(ttl_s)

    def rotate_api_key(self) -> str:
        """A new console key, kept in the keyring before anyone uses it, recorded in the key book
        (the old one is refused at once), then given to every subscriber (the running API, the
        console's chat). Removing a member calls this: older versions' assignments carried the
        console's key to every member."""
        key = new_secret()
        if self.secrets_store is not None:
            self.secrets_store.put(API_KEY_SECRET, key)
        if self.keys is not None:
            self.keys.adopt(CONSOLE_KEY_NAME, key)
        self.api_key, self.key_rotated = key, True
        for listener in list(self._key_listeners):
            listener(key)
        return key

    def issue_member_key(self, node_id: str, name: str) -> str:
        """A new API key for the tray chat of member ``node_id`` (named ``tray-<name>-<id prefix>``,
        replacing one it held); the secret goes to the member once, with its certificate."""
        if self.keys is None:
            raise DeskfleetError("this fleet host keeps no key book; it cannot issue a member's chat key")
        return issue_member_key(self.keys, node_id, name)

    def member_key(self, node_id: str | None) -> str | None:
        """The member-scoped API key ``node_id``'s assignments carry (for an older agent's tray chat; a
        newer one has its own from the join): issued once per run (a restart re-issues it, and the
        re-sent assignments carry the new one), limited to MEMBER_KEY_RPM/TPM, revoked with the member.
        None without a key book or a node id: the assignment then carries no key."""
        if self.keys is None or not node_id:
            return None
        key = self.member_keys.get(node_id)
        if key is None:
            key = self.keys.issue(assignment_key_name(node_id), node_id=node_id, rpm=MEMBER_KEY_RPM,
                                  tpm=MEMBER_KEY_TPM, replace_live=True).secret
            self.member_keys[node_id] = key
        return key

    def revoke_member_keys(self, node_id: str) -> tuple[str, ...]:
        """Revoke every key issued to member ``node_id`` (it was removed); their names."""
        self.member_keys.pop(node_id, None)
        return tuple(k.name for k in self.keys.revoke_member(node_id)) if self.keys is not None else ()

    def api_tls_context(self) -> ssl.SSLContext:
        """The server context the API is served over off loopback: the service certificate (role
        console) under the fleet CA; clients need no certificate, they pin the fleet CA and send a key."""
        return self.credentials.server_context(verify_clients=False)

    def subscribe_joins(self, listener: Callable[[str, str], None]) -> Callable[[], None]:
        """Call ``listener(node id, name)`` for every PC admitted from now on; returns an unsubscribe."""
        self.join_listeners.append(listener)
        return lambda: self.join_listeners.remove(listener) if listener in self.join_listeners else None

    def subscribe_api_key(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(new key)`` on each rotation; returns a function that unsubscribes."""
        self._key_listeners.append(listener)
        return lambda: self._key_listeners.remove(listener) if listener in self._key_listeners else None


@contextlib.asynccontextmanager
async def fleet_host(state_dir: Path, exports: dict[str, Path] | None = None, *, host: str = "127.0.0.1",
                     enrollment_port: int = 0, hub_port: int = 0, advertise_on: str | None = None,
                     name: str = "Deskfleet console") -> AsyncIterator[FleetHost]:
    """Run the console's enrollment endpoint and hub until the block exits.

    ``advertise_on``: an IPv4 address of this machine to advertise the enrollment port on
    (``_deskfleet-join._tcp``); ``name`` is the console's name in that record.
    """
    prepare_state_dir(state_dir)
    with state_dir_lock(state_dir):
        store = ConsoleSecrets(state_dir)
        authority = load_or_create_authority(state_dir, secrets_=store)
        book = KeyBook(state_dir)
        api_key = load_or_create_api_key(state_dir, secrets_=store, book=book)
        async with _fleet_services(state_dir, authority, api_key, exports, host=host, enrollment_port=enrollment_port,
                                   hub_port=hub_port, advertise_on=advertise_on, name=name, book=book) as fleet:
            fleet.secrets_store = store
            yield fleet


@contextlib.asynccontextmanager
async def _fleet_services(state_dir: Path, authority: FleetAuthority, api_key: str, exports: dict[str, Path] | None,
                          *, host: str, enrollment_port: int, hub_port: int, advertise_on: str | None,
                          name: str, book: KeyBook | None = None) -> AsyncIterator[FleetHost]:
    creds = load_or_create_console_credentials(state_dir, authority)  # agents pin its node id
    tokens = TokenBook(state_dir / "join-tokens.json", authority.fingerprint)
    keys = book or KeyBook(state_dir)
    audit = JoinAudit.in_dir(state_dir)
    join_listeners: list[Callable[[str, str], None]] = []

    def on_join(node_id: str, member: str, _info: object) -> None:
        for listener in list(join_listeners):  # one listener's fault must not fail the PC's join
            try:
                listener(node_id, member)
            except Exception:
                log.exception("a join listener failed for node %s (%s)", node_id[:16], member)

    enrollment = EnrollmentServer(authority, tokens, creds, on_join=on_join, audit=audit,
                                  issue_chat_key=lambda node_id, member: issue_member_key(keys, node_id, member))
    enroll_host, enroll_port = await enrollment.async_start(host, enrollment_port)
    hub = FleetHub(creds)
    advertiser = ConsoleAdvertiser(advertise_on) if advertise_on else None
    try:
        for export_id, path in (exports or {}).items():
            hub.publish(export_id, path)
        await hub.async_start(host, hub_port)
        if advertiser is not None:
            await advertiser.async_start(console_advertisement(name, authority.fingerprint, enroll_port,
                                                               advertiser.interface, __version__))
        yield FleetHost(authority, creds, tokens, f"{enroll_host}:{enroll_port}", hub, api_key, keys=keys,
                        audit=audit, join_listeners=join_listeners)
    finally:
        if advertiser is not None:
            await advertiser.async_close()
        await hub.async_close()
        await enrollment.async_close()
