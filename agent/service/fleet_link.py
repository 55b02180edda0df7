"""How the agent reaches its console: finding consoles over mDNS and joining through one (a token
redeemed at each found console of the token's fleet in turn), registering by address with the seed
fleet services (networks that drop multicast), and telling the fleet service's hub about events (a pause, a
lost worker). Every connection to the hub pins a service-role certificate, and the one pinned at
the join when there is one: what the agent says is for the fleet service alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from engine.control.enrollment import Joined, async_join
from engine.control.hub_events import MAX_DETAIL_CHARS, MAX_REASON_CHARS, MAX_REASONS
from engine.control.messages import Assignment
from engine.discovery.join_service import async_find_consoles
from engine.errors import EnrollmentError, EnrollmentTimeout, JoinRefused, TrustError
from engine.trust.fleet_ca import Credentials, Role
from engine.trust.join_token import parse_token
from engine.trust.tls_peer import PeerCheckingConnector, PeerIdentityError, expect_peer

log = logging.getLogger(__name__)

NOTIFY_TIMEOUT_S = 3.0
CANDIDATE_TIMEOUT_S = 8.0  # one fleet service found over mDNS: fetch the CA, check it, redeem the token
REGISTER_TIMEOUT_S = 5.0


def service_connector(service_node_id: str | None) -> PeerCheckingConnector:
    """Connections to the fleet service's hub: a fleet service certificate, the pinned one if any."""
    return PeerCheckingConnector(expect_peer(Role.FLEET_SERVICE, service_node_id, what="the fleet service's hub"))


async def async_join_found_service(interface: str, token: str, name: str, info: Mapping[str, Any] | None,
                                   timeout: float) -> Joined:
    """Join through a fleet service found over mDNS: those whose record names the token's fleet, tried
    side by side (the join itself checks the CA against the token's pin)."""
    pin = parse_token(token).ca_pin  # a mistyped token is reported before any search
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    consoles = await async_find_consoles(interface, pin=pin, timeout=min(timeout / 2, 6.0))
    candidates = list(dict.fromkeys(c.enrollment for c in consoles if c.ca_pin == pin))
    if not candidates:
        raise EnrollmentError(
            f"no console of fleet {pin[:16]} answered on the network ({interface}); check that the "
            "console is running on this network, or enter its address (host:port, shown next to the token)")

    async def attempt(address: str, budget: float) -> Joined:
        return await async_join(address, token, name, info=info, timeout=budget)
    return await async_join_first(candidates, attempt, max(deadline - loop.time(), 1.0))


async def async_join_first(candidates: Sequence[str], attempt: Callable[[str, float], Awaitable[Joined]],
                           timeout: float, *, per_candidate_s: float = CANDIDATE_TIMEOUT_S) -> Joined:
    """The first join that succeeds among ``candidates`` (enrollment addresses), all tried at once,
    each within ``per_candidate_s`` (and ``timeout`` in all): an mDNS record anyone on the network
    can forge, pointing at an address that never answers, costs one candidate's time, not the
    join's (review L7). A refusal by the fleet's own fleet service (JoinRefused) is final; any other
    failure (a spoofed or stale record, a member posing as the fleet service) leaves the others to try.
    """
    budget = min(per_candidate_s, timeout)
    tasks = {asyncio.ensure_future(attempt(address, budget)): address for address in candidates}
    error: TrustError | None = None
    try:
        for next_done in asyncio.as_completed(tasks, timeout=timeout + 1.0):
            try:
                return await next_done
            except JoinRefused:
                raise  # the fleet's own fleet service (CA matched the pin, service-role certificate) said no
            except (EnrollmentTimeout, TimeoutError) as exc:
                log.warning("joining through a fleet service found on the network failed: %s", exc)
            except TrustError as exc:
                log.warning("joining through a fleet service found on the network failed: %s", exc)
                error = exc
    except TimeoutError:
        pass  # every candidate's own timeout is shorter: a last resort
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if error is not None:  # a candidate that answered said why (a record of another fleet, a member)
        raise error
    raise EnrollmentError(f"none of the {len(candidates)} consoles found on the network for this fleet answered in "
                          f"{timeout:.0f} s; enter the fleet service's address (host:port, shown next to the token)")


async def async_tell_service(assignment: Assignment, creds: Credentials, service_node_id: str | None, event: str,
                             reasons: Sequence[str], detail: str | None = None) -> None:
    """Post one event to the hub the assignment names (best effort: a fleet service that is away learns
    it from its next poll)."""
    if assignment.events_url is None:
        return
    body = {"node_id": creds.node_id, "event": event, "reasons": [r[:MAX_REASON_CHARS] for r in reasons][:MAX_REASONS],
            "export_id": assignment.export_id, "stage": assignment.stage,
            "detail": detail[:MAX_DETAIL_CHARS] if detail else detail}  # the hub keeps no more, nor takes 4 KiB+
    try:
        timeout = aiohttp.ClientTimeout(total=NOTIFY_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, connector=service_connector(service_node_id)) as session:
            async with session.post(assignment.events_url, json=body, ssl=creds.client_context()) as resp:
                resp.release()
    except (aiohttp.ClientError, TimeoutError, OSError, PeerIdentityError) as exc:
        log.debug("could not tell the fleet service about %s: %s", event, exc)


async def async_register_with_seeds(creds: Credentials, service_node_id: str | None, seeds: Sequence[str],
                                    body: Mapping[str, Any]) -> int:
    """Register with every seed fleet service by address; how many accepted."""
    accepted = 0
    timeout = aiohttp.ClientTimeout(total=REGISTER_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=service_connector(service_node_id)) as session:
        for seed in seeds:
            try:
                async with session.post(f"https://{seed}/v1/register", json=dict(body),
                                        ssl=creds.client_context()) as resp:
                    accepted += resp.status == 200
            except (aiohttp.ClientError, TimeoutError, OSError, PeerIdentityError) as exc:
                log.debug("seed fleet service %s unreachable: %s", seed, exc)
    return accepted
