"""The shard store: where an agent keeps the files of its assigned stage, and how it gets them.

Layout: ``<state dir>/shards/<export id>/manifest.json`` plus the stage's files at the paths the
manifest names (every path goes through :func:`engine.shards.manifest.safe_join`, so nothing a fleet service
sends can escape the store). A download writes ``<file>.part`` and resumes from its length with
an HTTP Range request; a file becomes visible under its real name only after its sha256
matched. Verified files are remembered by (size, mtime) in ``.verified.json``, so re-running a
fetch after a partial failure never downloads or re-hashes them again.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from ssl import SSLContext

import aiohttp

from engine.atomic_file import write_json_atomic, write_text_atomic
from engine.control.messages import Assignment, ControlRequestError, FetchProgress
from engine.errors import DeskfleetError, ShardIntegrityError
from engine.shards.manifest import MANIFEST_NAME, FileEntry, safe_join, sha256_file
from engine.trust.fleet_ca import Role
from engine.trust.tls_peer import PeerCheckingConnector, async_read_limited, expect_peer

log = logging.getLogger(__name__)

DISK_MARGIN_BYTES = 64 << 20
_CHUNK = 256 << 10
MAX_ERROR_BYTES = 4096  # of a refused fetch's body: enough for the reason, never a whole file
_VERIFIED = ".verified.json"


class FetchError(DeskfleetError):
    """A shard download failed (network, HTTP status, hash mismatch); re-running it resumes."""


class ShardStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def directory(self, export_id: str) -> Path:
        return safe_join(self.root, export_id)

    def _marks(self, export_id: str) -> dict[str, list]:
        path = self.directory(export_id) / _VERIFIED
        try:
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}  # a lost or damaged cache only costs a re-hash

    def _mark(self, export_id: str, entry: FileEntry, path: Path) -> None:
        marks = self._marks(export_id)
        st = path.stat()
        marks[entry.path] = [st.st_size, st.st_mtime_ns, entry.sha256]
        write_json_atomic(self.directory(export_id) / _VERIFIED, marks)

    def is_verified(self, export_id: str, entry: FileEntry, *, rehash: bool = False) -> bool:
        path = safe_join(self.directory(export_id), entry.path)
        if not path.is_file():
            return False
        st = path.stat()
        if st.st_size != entry.size:
            return False
        if not rehash and self._marks(export_id).get(entry.path) == [st.st_size, st.st_mtime_ns, entry.sha256]:
            return True
        if sha256_file(path) != entry.sha256:
            return False
        self._mark(export_id, entry, path)
        return True

    def missing(self, assignment: Assignment) -> list[FileEntry]:
        """The stage files not yet present and verified."""
        return [e for e in assignment.files() if not self.is_verified(assignment.export_id, e)]

    def write_manifest(self, assignment: Assignment) -> Path:
        directory = self.directory(assignment.export_id)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / MANIFEST_NAME
        write_text_atomic(path, assignment.manifest_json)
        return directory

    def check_space(self, assignment: Assignment) -> None:
        """Refuse (HTTP 507) a download the disk cannot hold, before a byte is written."""
        directory = self.directory(assignment.export_id)
        directory.mkdir(parents=True, exist_ok=True)
        needed = 0
        for entry in self.missing(assignment):
            part = _part(safe_join(directory, entry.path))
            needed += entry.size - (part.stat().st_size if part.is_file() else 0)
        free = shutil.disk_usage(directory).free
        if needed + DISK_MARGIN_BYTES > free:
            raise ControlRequestError(
                f"the shard needs {needed / 1e6:.0f} MB (+{DISK_MARGIN_BYTES >> 20} MB margin) but only "
                f"{free / 1e6:.0f} MB is free in {self.root}; free some disk space or choose another PC", 507)

    def prune(self, keep: str) -> None:
        """Remove every other export's files (an agent serves one stage at a time)."""
        if not self.root.is_dir():
            return
        for child in self.root.iterdir():
            if child.is_dir() and child.name != keep:
                shutil.rmtree(child, ignore_errors=True)


def _part(path: Path) -> Path:
    return path.with_name(path.name + ".part")


class _Throttle:
    """Sleep as needed to keep the average rate under ``cap`` bytes/s (None: no cap)."""

    def __init__(self, cap: int | None) -> None:
        self.cap, self.start, self.bytes = cap, time.monotonic(), 0

    async def async_account(self, n: int) -> None:
        self.bytes += n
        if self.cap:
            ahead = self.bytes / self.cap - (time.monotonic() - self.start)
            if ahead > 0:
                await asyncio.sleep(ahead)


async def async_fetch(store: ShardStore, assignment: Assignment, *, ssl: SSLContext | None,
                      on_progress: Callable[[FetchProgress], None] = lambda p: None,
                      bandwidth_cap: int | None = None, timeout: float = 60.0,
                      service_node_id: str | None = None) -> None:
    """Download and verify every missing file of the assignment's stage, resuming partial files.
    Over TLS the hub must hold a fleet service certificate (``service_node_id``: that fleet service's).

    Raises FetchError, PeerIdentityError (someone else answered at the hub's address), or
    ControlRequestError 507 for disk space; what was verified stays.
    """
    directory = store.write_manifest(assignment)
    store.check_space(assignment)
    entries = list(assignment.files())
    total = sum(e.size for e in entries)
    todo = store.missing(assignment)
    done = total - sum(e.size for e in todo)
    throttle = _Throttle(bandwidth_cap)
    on_progress(FetchProgress(done, total))
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    connector = None if ssl is None else PeerCheckingConnector(
        expect_peer(Role.FLEET_SERVICE, service_node_id, what=f"the fleet service's hub at {assignment.source}"))
    async with aiohttp.ClientSession(timeout=client_timeout, connector=connector) as session:
        for entry in todo:
            dest = safe_join(directory, entry.path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = _part(dest)
            offset = part.stat().st_size if part.is_file() else 0
            if offset > entry.size:
                part.unlink()
                offset = 0
            done += offset
            url = assignment.source + urllib.parse.quote(entry.path)
            headers = {"Range": f"bytes={offset}-"} if offset else {}
            try:
                async with session.get(url, headers=headers, ssl=ssl if ssl is not None else True) as resp:
                    if resp.status == 200 and offset:
                        done -= offset  # the server ignored the range: start the file over
                        offset = 0
                        part.unlink(missing_ok=True)
                    elif resp.status not in (200, 206):
                        what = f"fetching {entry.path} from {assignment.source}: HTTP {resp.status}"
                        body = await async_read_limited(resp, MAX_ERROR_BYTES, functools.partial(_fetch_error, what))
                        raise FetchError(f"{what} {body[:200].decode('utf-8', 'replace')}")
                    with open(part, "ab") as f:
                        async for chunk in resp.content.iter_chunked(_CHUNK):
                            if f.tell() + len(chunk) > entry.size:
                                raise FetchError(f"{entry.path}: the server sent more than the manifest's "
                                                 f"{entry.size} bytes")
                            f.write(chunk)
                            done += len(chunk)
                            await throttle.async_account(len(chunk))
                            on_progress(FetchProgress(done, total, entry.path))
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise FetchError(f"fetching {entry.path} from {assignment.source} failed ({exc!r}); "
                                 "fetch again to resume") from exc
            if part.stat().st_size != entry.size or sha256_file(part) != entry.sha256:
                part.unlink()
                raise ShardIntegrityError(f"downloaded {entry.path} does not match its sha256/size in the "
                                          "manifest; it was discarded, fetch again")
            os.replace(part, dest)
            store.is_verified(assignment.export_id, entry)  # records the mark
            log.info("fetched and verified %s (%d bytes)", entry.path, entry.size)
    on_progress(FetchProgress(total, total, None, finished=True))


def _fetch_error(what: str, message: str) -> FetchError:
    return FetchError(f"{what} ({message})")
