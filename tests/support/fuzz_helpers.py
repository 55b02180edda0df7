"""Shared pieces of the live fuzz tests: one server per module on its own loop thread, a blocking
keep-alive HTTP(S) client the hypothesis examples drive it with, the checks every answer must pass,
and strategies for hostile JSON.

Every live fuzz module declares ``CASES`` ({case family: max_examples}); its tests run exactly
that many examples (hypothesis derandomized, no example database) and assert they did, and
``tests/architecture/test_fuzz_budget.py`` sums the declarations.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

T = TypeVar("T")
ANSWER_TIMEOUT_S = 15.0  # every request must be answered within this
TRACEBACK_MARKERS = ("Traceback (most recent call last)", 'File "/')


def fuzz_settings(max_examples: int) -> settings:
    """Deterministic (same examples on every run), no example database, no per-example deadline."""
    return settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False)


class LoopThread:
    """An asyncio loop on a daemon thread; ``run(coro)`` blocks the caller until it finishes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-server-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        async def _cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(_cancel_rest(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the fuzz server loop did not stop"
        self.loop.close()


@contextlib.contextmanager
def loop_thread() -> Iterator[LoopThread]:
    runner = LoopThread()
    try:
        yield runner
    finally:
        runner.close()


@contextlib.contextmanager
def served_paged(export, settings, *,
                 prefix_cache: bool = True) -> Iterator[tuple[LoopThread, object, object, object]]:
    """The OpenAI API over the tiny export's paged coordinator (4 slots, exact, a 16 MiB block pool,
    warmed up with one short request) on a loop thread of its own: (loop, coordinator, api, tokenizer).
    ``prefix_cache=False`` for a test that compares seeded samples across requests: a prompt served
    from shared blocks is computed in another batch than the first time, and the last bits of its
    logits may differ, enough to flip a seeded draw at a near tie."""
    from engine.api.server import async_run_api
    from engine.generation.request import GenerationRequest
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator

    tokenizer = ChatTokenizer(export / "tokenizer")
    with loop_thread() as loop:
        coordinator = BatchCoordinator.local(export, slots=4, exact=True, kv_pool_bytes=16 << 20,
                                             prefix_cache=prefix_cache)
        loop.run(coordinator.__aenter__())
        try:
            async def warm_up():
                return [e async for e in coordinator.stream(GenerationRequest((1, 5, 9), 2))]

            loop.run(warm_up())
            api = loop.run(async_run_api(coordinator, tokenizer, settings))
            try:
                yield loop, coordinator, api, tokenizer
            finally:
                loop.run(api.async_stop())
        finally:
            loop.run(coordinator.__aexit__(None, None, None))



@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip()

    def json(self) -> Any:
        return json.loads(self.body)


class NoAnswer(AssertionError):
    """The server closed the connection or stayed silent instead of answering a request."""


class HttpClient:
    """One keep-alive HTTP(S) connection to a live server, reopened whenever the server ends it.

    ``request`` sends exactly what it is given (any method, any percent-encoded path, any body and
    content type) and returns the answer; no answer within ``timeout`` raises :class:`NoAnswer`.
    """

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None, *,
                 timeout: float = ANSWER_TIMEOUT_S) -> None:
        self.host, self.port, self.ssl_context, self.timeout = host, port, ssl_context, timeout
        self._conn: http.client.HTTPConnection | None = None
        self.requests = 0

    def _open(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.ssl_context is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            else:
                self._conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                                         context=self.ssl_context)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None) -> Reply:
        self.requests += 1
        headers = dict(headers or {})
        for attempt in (1, 2):
            conn = self._open()
            fresh = conn.sock is None
            try:
                try:
                    conn.request(method, path, body=body, headers=headers)
                except (OSError, http.client.HTTPException):
                    if conn.sock is None:
                        raise
                    # The server may answer a request line or body it refuses before reading the
                    # rest, then close: what it sent is still there to be read.
                response = conn.getresponse()
                data = response.read()
            except TimeoutError as exc:
                self.close()
                raise NoAnswer(f"{method} {path[:120]}: no answer within {self.timeout:g} s") from exc
            except (OSError, http.client.HTTPException) as exc:  # reset, TLS EOF, closed mid-request
                self.close()
                if attempt == 1 and not fresh:
                    continue  # the server had ended the keep-alive connection before this request: once more
                raise NoAnswer(f"{method} {path[:120]} ({len(body)} B): connection ended without an "
                               f"answer ({exc!r})") from exc
            if response.will_close:
                self.close()
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
        raise AssertionError("unreachable")


def assert_clean_refusal(reply: Reply, what: str, *, json_error: Callable[[Any], bool] | None = None) -> None:
    """A 4xx that explains itself: no 5xx, no traceback, and (``json_error``) the documented error body."""
    text = reply.body.decode("utf-8", "replace")
    assert 400 <= reply.status < 500, f"{what}: expected a 4xx, got {reply.status}: {text[:300]}"
    assert not any(marker in text for marker in TRACEBACK_MARKERS), f"{what}: traceback in the body: {text[:500]}"
    if json_error is not None:
        assert reply.content_type == "application/json", f"{what}: {reply.status} is {reply.content_type}: {text[:200]}"
        assert json_error(reply.json()), f"{what}: error body not in the documented shape: {text[:300]}"


def unexpected_errors(records: list[logging.LogRecord], prefixes: tuple[str, ...]) -> list[str]:
    """ERROR records from loggers under ``prefixes``, except aiohttp's note of a request line or
    header it could not parse (it answers those 400 itself): an unhandled exception is logged
    here before the client gets its 500."""
    from aiohttp.http_exceptions import HttpProcessingError

    def parse_error(r: logging.LogRecord) -> bool:
        exc = r.exc_info[1] if r.exc_info else None
        return isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500

    return [r.getMessage() for r in records
            if r.levelno >= logging.ERROR and r.name.startswith(prefixes) and not parse_error(r)]


def assert_answered(reply: Reply, what: str) -> None:
    """Any answer but a server error."""
    text = reply.body.decode("utf-8", "replace")
    assert reply.status < 500, f"{what}: server error {reply.status}: {text[:500]}"
    assert "Traceback (most recent call last)" not in text, f"{what}: traceback in the body: {text[:500]}"


# -- strategies ------------------------------------------------------------------------------------

HUGE_NUMBERS = (10**30, -(10**30), 2**63, 2**64 + 1, -(2**63) - 1, 1e308, -1e308, 1e-320, -0.0, 10**4000)
NASTY_TEXT = ("", " ", "\u0000", "\ud800", "\udfff", "\U0001f600" * 50, "\u202e\u2066", "é" * 300, "\\",
              "${jndi:ldap://x}", "<script>", "' OR 1=1 --", "%s%s%n", "\r\nX-Injected: 1", "A" * 5000)


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE_NUMBERS),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.sampled_from(NASTY_TEXT))


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON-ish value, NaN/Infinity and 4000-digit integers included (Python's json emits them)."""
    return st.recursive(scalars(), lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=max_leaves)


def dumps(value: Any) -> bytes:
    """JSON as a hostile client would send it: NaN and lone surrogates allowed."""
    return json.dumps(value, allow_nan=True).encode()


def nested(depth: int) -> bytes:
    """A body nested ``depth`` arrays deep: enough to exhaust a recursive parser."""
    return b"[" * depth + b"]" * depth


class Blob(bytes):
    """Bytes whose repr stays short in a falsifying example."""

    def __repr__(self) -> str:
        return f"Blob({bytes(self[:24])!r}... {len(self)} B)" if len(self) > 32 else f"Blob({bytes(self)!r})"


RAW_BODIES = tuple(Blob(b) for b in (
    b"", b"{", b"[]", b"null", b"0", b'"x"', b"\xff\xfe\x00", b"{\"a\":}", nested(100_000), nested(900),
    b"{\"a\": " + b"9" * 5000 + b"}", b"\x00" * 64, "{\"\u00e9\": \"\ud800\"}".encode("utf-8", "surrogatepass"),
    b'{"a": NaN, "b": -Infinity}', b'{"a": 1}' * 2, b"\xef\xbb\xbf{}"))
CONTENT_TYPES = ("application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                 "application/json; charset=latin-1", "application/octet-stream", "", "*/*; q=\u00e9")
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "FOO", "get")
TRAVERSALS = ("..", "../..", "%2e%2e", "%2E%2E%2F", "..%2f..%2f", "..%5c..%5c", "%00", "..;", "/etc/passwd",
              "//etc/passwd", "./", "%252e%252e", "%E2%80%A5", "...", "~", "%c0%ae%c0%ae")


def segments() -> st.SearchStrategy[str]:
    """One URL path segment: percent-encoded random text, or a traversal attempt as is."""
    return st.one_of(st.text(max_size=16).map(lambda s: quote(s, safe="")), st.sampled_from(TRAVERSALS))


def paths(prefixes: tuple[str, ...]) -> st.SearchStrategy[str]:
    """A path under one of ``prefixes`` (known routes), or anywhere, with random segments appended."""
    return st.builds(lambda base, rest, query: base + "/".join(rest) + query,
                     st.sampled_from(prefixes + ("/", "/v1/", "/v2/", ""))
                     .map(lambda p: p if p.startswith("/") else "/" + p),
                     st.lists(segments(), max_size=4),
                     st.sampled_from(("", "?", "?a=1", "?bytes=-1", "?bytes=99999999999999999999", "?%zz")))


# The marks of every live fuzz module: the slow lane, hypothesis's warning about the servers'
# threads drawing from `random` silenced, and no_server_errors (tests/conftest.py) on each test.
LIVE_FUZZ = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning"),
    pytest.mark.usefixtures("no_server_errors"),
]
