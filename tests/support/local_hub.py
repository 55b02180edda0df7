"""A Hugging Face hub on loopback for the pull tests: the routes ``huggingface_hub`` uses to list a
repository and fetch its files (``GET /api/models/{repo}[/revision/{rev}]``, ``HEAD``/``GET
/{repo}/resolve/{rev}/{file}`` with ranges), serving repositories the tests build in memory.

It can misbehave on purpose: ``cut_once[name] = n`` closes the first transfer of that file after
``n`` bytes (the client must resume it with a range request), ``corrupt`` serves other bytes than
it lists hashes for, and ``requests`` records every request (method, path, Range) to assert on.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


@dataclass
class LocalHub:
    repos: Mapping[str, Mapping[str, bytes]]  # repo id -> file name -> content
    cut_once: dict[str, int] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)
    listed_sizes: dict[str, int] = field(default_factory=dict)  # file name -> the size the listing claims
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""

    def commit(self, repo: str) -> str:
        h = hashlib.sha1(repo.encode(), usedforsecurity=False)
        for name, content in sorted(self.repos[repo].items()):
            h.update(name.encode() + hashlib.sha256(content).digest())
        return h.hexdigest()

    def _sibling(self, name: str, content: bytes) -> dict:
        size = self.listed_sizes.get(name, len(content))
        entry: dict = {"rfilename": name, "size": size,
                       "blobId": hashlib.sha1(f"blob {len(content)}\0".encode() + content,
                                              usedforsecurity=False).hexdigest()}
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"size": size, "sha256": hashlib.sha256(content).hexdigest(), "pointerSize": 134}
        return entry

    async def _info(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path, None))
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in self.repos:
            return web.json_response({"error": "Repository not found"}, status=404,
                                     headers={"X-Error-Code": "RepoNotFound"})
        return web.json_response({"id": repo, "sha": self.commit(repo), "private": False,
                                  "siblings": [self._sibling(n, c) for n, c in self.repos[repo].items()]})

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        name = request.match_info["file"]
        self.requests.append((request.method, request.path, request.headers.get("Range")))
        if repo not in self.repos or name not in self.repos[repo]:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
        content = self.repos[repo][name]
        etag = self._sibling(name, content).get("lfs", {}).get("sha256") or self._sibling(name, content)["blobId"]
        if name in self.corrupt:
            content = bytes(b ^ 0x5A for b in content)
        headers = {"X-Repo-Commit": self.commit(repo), "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        start = 0
        if request.headers.get("Range", "").startswith("bytes="):
            start = int(request.headers["Range"][6:].split("-")[0])
        body = content[start:]
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers, "Content-Length": str(len(content))})
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(content) - 1}/{len(content)}"
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = len(body)
        await response.prepare(request)
        cut = self.cut_once.pop(name, None)
        if cut is not None and request.transport is not None:
            await response.write(body[:cut])
            request.transport.close()  # the transfer is cut in the middle
            return response
        await response.write(body)
        await response.write_eof()
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}", self._info)
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_route("HEAD", "/{org}/{name}/resolve/{rev}/{file:.+}", self._resolve)
        app.router.add_get("/{org}/{name}/resolve/{rev}/{file:.+}", self._resolve, allow_head=False)
        return app


@contextmanager
def serving(hub: LocalHub) -> Iterator[LocalHub]:
    """``hub`` listening on 127.0.0.1 (its ``url`` set) on a thread of its own until the block ends."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, web.AppRunner] = {}

    async def start() -> None:
        runner = web.AppRunner(hub.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"] = runner
        hub.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="local-hub", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the local hub did not start")
    try:
        yield hub
    finally:
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
