"""The admin API's key routes (docs/ADMIN_API.md, "Keys"): the OpenAI API's named keys, kept by
:class:`engine.trust.key_book.KeyBook` in the service's state dir. The running API re-reads the
book when it changes, so a revocation here is refused on its next request; a secret is answered
once, when issued, and never listed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from console.service.admin_shapes import field

if TYPE_CHECKING:
    from console.service.admin_api import AdminApi

CONSOLE_KEY = "console"


def _book(api: AdminApi):
    from engine.trust.key_book import KeyBook

    return KeyBook(api.service.settings.state_dir)


def _keys_json(api: AdminApi) -> list[dict[str, Any]]:
    return [k.to_json() for k in _book(api).keys() if k.live]


def add_key_routes(app: web.Application, api: AdminApi) -> None:
    from console.service.admin_api import PREFIX, AdminError

    def conflict(exc: Exception) -> AdminError:
        from engine.trust.key_book import KeyNameError

        if isinstance(exc, KeyNameError):
            status = 404 if "no live key" in str(exc) else 409
            return AdminError(status, "not_found" if status == 404 else "conflict", str(exc))
        return AdminError(409, "conflict", str(exc))

    async def keys(request: web.Request) -> web.Response:
        return web.json_response({"keys": _keys_json(api)})

    async def issue(request: web.Request) -> web.Response:
        body = await api.body(request)
        try:
            issued = _book(api).issue(field(body, "name", str), rpm=field(body, "rpm", int, optional=True),
                                      tpm=field(body, "tpm", int, optional=True))
        except Exception as exc:
            if type(exc).__name__ in ("KeyNameError", "KeyBookError"):
                raise conflict(exc) from exc
            raise
        api.service.feed.publish("keys", {"keys": _keys_json(api)})
        return web.json_response({**issued.key.to_json(), "secret": issued.secret})

    async def revoke(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            _book(api).revoke(name)
        except Exception as exc:
            if type(exc).__name__ in ("KeyNameError", "KeyBookError"):
                raise conflict(exc) from exc
            raise
        api.service.feed.publish("keys", {"keys": _keys_json(api)})
        return web.json_response({"revoked": name})

    async def console_secret(request: web.Request) -> web.Response:
        if request.match_info["name"] != CONSOLE_KEY:
            raise AdminError(403, "forbidden", "only the console's own key is handed out again; another key's "
                                               "secret was shown once, when it was issued")
        return web.json_response({"secret": api.service.host.api_key})

    app.router.add_get(f"{PREFIX}/keys", keys)
    app.router.add_post(f"{PREFIX}/keys", issue)
    app.router.add_post(f"{PREFIX}/keys/{{name}}/secret", console_secret)
    app.router.add_delete(f"{PREFIX}/keys/{{name}}", revoke)
