"""Request hygiene for the OpenAI API, as pure policy: who may address it, what it accepts,
and where it may be served without TLS (loopback only: :func:`check_exposure`).

Two checks run before a request costs anything (:mod:`engine.api.server` applies them):

* **Host.** A browser page on another site can make the browser send requests to this API;
  with DNS rebinding its own host name even resolves to this machine, so the request looks
  same-origin to the browser. What it cannot forge is the ``Host`` header: it is the page's
  name. So only names this server is known by are accepted: the address it is bound to,
  the loopback names, and names the admin configured. A server bound to every interface
  (``0.0.0.0``, ``::``) also takes any IP literal: a rebinding page can only send a name.
* **Content type.** A cross-site HTML form can POST without a CORS preflight, but only as
  ``text/plain``, ``multipart/form-data`` or ``application/x-www-form-urlencoded``; requiring
  ``application/json`` refuses all of them.

(The third cheap check, a prompt too long to be worth tokenising, is the parse stage's:
:func:`engine.api.openai_schema.check_prompt_chars`.)
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Iterable

from engine.api.api_error import ApiError
from engine.errors import DeskfleetError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
JSON_TYPE = "application/json"


def host_name(header: str) -> str | None:
    """The host part of a ``Host`` header, lower-case, without port or trailing dot
    (``"[::1]:8000"`` -> ``"::1"``); None if it is not a well-formed host."""
    header = header.strip().lower()
    if header.startswith("["):
        name, sep, rest = header[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        name, sep, port = header.rpartition(":") if header.count(":") == 1 else (header, "", "")
        if sep and not port.isdigit():
            return None
        name = name if sep else header
    name = name.rstrip(".")
    return name or None


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which ``Host`` headers a server bound to ``bind`` answers (see the module docstring)."""

    def __init__(self, bind: str, extra: Iterable[str] = ()) -> None:
        self.any_ip = bind in WILDCARD_BINDS
        names = set(LOOPBACK_NAMES) | {n for n in (host_name(h) for h in extra) if n}
        if not self.any_ip:
            names.add(host_name(f"[{bind}]" if ":" in bind else bind) or bind.lower())
        self.names = frozenset(names)

    def allows(self, header: str | None) -> bool:
        name = host_name(header) if header else None
        if name is None:
            return False
        return name in self.names or (self.any_ip and is_ip(name))

    def check(self, header: str | None) -> None:
        """Raise ApiError 421 unless ``header`` names this server."""
        if not self.allows(header):
            raise ApiError(421, f"this server does not answer to the host name {header!r}; address it by "
                           f"one of {', '.join(sorted(self.names))} (a page on another site cannot use "
                           "this API)", "wrong_host")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only (127.0.0.0/8, ::1, ``localhost``); a
    wildcard (``0.0.0.0``, ``::``, empty) or any other address is not."""
    if host.strip().lower().rstrip(".") in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, *, tls: bool) -> None:
    """Refuse (DeskfleetError) to serve plain HTTP on ``host`` unless it is a loopback address:
    anyone on the network could read the keys and the conversations."""
    if not tls and not is_loopback(host):
        raise DeskfleetError(f"refusing to serve the API over plain HTTP on {host}: keys and conversations would "
                             "cross the network in clear. Serve it over TLS with the fleet's service certificate "
                             "(the fleet service does), or bind it to 127.0.0.1")


def api_client_context(ca_pem: bytes) -> ssl.SSLContext:
    """A client context for the API over TLS: trusts only the fleet CA (``ca_pem``); host names are
    not checked (the service is reached by IP, as every fleet member is; the CA is the identity)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=ca_pem.decode("ascii"))
    return ctx


def check_json_type(content_type: str) -> None:
    """Raise ApiError 415 unless a POST body is declared ``application/json``."""
    if content_type != JSON_TYPE:
        raise ApiError(415, f"the request body must be sent as Content-Type: {JSON_TYPE}, not "
                       f"{content_type or 'none'!r}", "unsupported_media_type")
