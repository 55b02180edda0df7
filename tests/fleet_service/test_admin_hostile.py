"""The admin HTTPS against hostile requests (security review L1, L2, L9), live on loopback with a
real admin certificate: a web page in a browser holding that certificate (an Origin header, a
``text/plain`` body, a foreign Host) is refused; a body with Infinity/NaN or nested 5,000 deep is
a clear 400, never a 500; an auto-approving token without a finite, bounded lifetime is refused."""

from __future__ import annotations

import aiohttp
import pytest

from tests.fleet_service.admin import PREFIX

pytestmark = pytest.mark.usefixtures("private_keyring")


def test_the_admin_https_refuses_browser_shaped_and_hostile_bodies(shared_service, caplog):
    async def main():
        service = shared_service.service
        ctx = service.host.authority.issue_admin("alice").client_context()
        url = f"{service.admin_url}{PREFIX}/tokens"
        answers = {}
        async with aiohttp.ClientSession() as session:
            async def post(what: str, data: str, **headers: str) -> None:
                headers.setdefault("Content-Type", "application/json")
                async with session.post(url, data=data, headers=headers, ssl=ctx) as reply:
                    answers[what] = reply.status, (await reply.json())["error"]["message"] if reply.status >= 400 \
                        else await reply.json()

            await post("origin", '{"label": "x"}', Origin="https://evil.example")
            await post("text/plain", '{"label": "x"}', **{"Content-Type": "text/plain"})
            await post("foreign host", '{"label": "x"}', Host="evil.example")
            await post("Infinity", '{"ttl_s": Infinity, "auto_approve": true}')
            await post("NaN", '{"ttl_s": NaN}')
            await post("1e300", '{"ttl_s": 1e300, "auto_approve": true}')
            await post("31 days", '{"ttl_s": 2678400, "auto_approve": true}')
            await post("deep", '{"label": ' + "[" * 5000 + "]" * 5000 + "}")
            await post("fine", '{"label": "floor 3", "ttl_s": 3600, "auto_approve": true}')
        return answers

    answers = shared_service.run(main(), 120)
    assert answers["origin"][0] == 403 and "Origin" in answers["origin"][1]
    assert answers["text/plain"][0] == 415 and "application/json" in answers["text/plain"][1]
    assert answers["foreign host"][0] == 421 and "evil.example" in answers["foreign host"][1]
    for what in ("Infinity", "NaN"):
        assert answers[what][0] == 400 and what in answers[what][1], answers[what]
    for what in ("1e300", "31 days"):
        assert answers[what][0] == 400 and "ttl" in answers[what][1], answers[what]
    assert answers["deep"][0] == 400 and "nests too deeply" in answers["deep"][1]
    assert answers["fine"][0] == 200 and answers["fine"][1]["token_info"]["auto_approve"]
    assert not [r for r in caplog.records if r.exc_info], "a hostile body logged a traceback"
