"""Where the fleet service is reached: its OpenAI API (started on the interface, advertised over
mDNS) and the service file (``fleet-service.json``) that tells a local console where to attach.
The fleet service (:mod:`console.fleet.fleet_service`) starts these when it opens; none of them
holds state of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from console.fleet.api_advert import ApiAdvertError, ApiAdvertisement, ApiAdvertiser
from console.fleet.ring_endpoints import free_port
from console.fleet.served_rings import ServedRings
from console.fleet_api.fleet_settings import FleetSettings
from console.fleet_api.service_locator import SERVICE_FILE
from engine.api.audit import AuditLog
from engine.api.guard import is_loopback
from engine.api.server import RunningApi, async_run_api
from engine.atomic_file import write_text_atomic
from engine.control.fleet_services import FleetHost
from engine.generation.router import Router
from engine.generation.tokenizer import ChatTokenizer

log = logging.getLogger("deskfleet.fleet")


async def async_run_service_api(fleet: FleetSettings, host: FleetHost, served: ServedRings, router: Router,
                                tokenizers: dict[str, ChatTokenizer]) -> RunningApi:
    """The OpenAI API over ``router``: keys from the fleet's book (tray keys, named keys,
    "console"), one audit line per request, TLS with the service certificate off loopback (plain
    HTTP is refused there). Port 0 keeps the port of the last run: agents learn the API's address
    with their assignment."""
    port = fleet.api_port
    if port == 0:
        port = served.state.api_port or free_port(fleet.interface)
    api_settings = dataclasses.replace(fleet.api, api_key=fleet.api.api_key or host.api_key,
                                       allowed_hosts=(*fleet.api.allowed_hosts, socket.gethostname()))
    api = await async_run_api(router, tokenizers, api_settings, fleet.interface, port, keys=host.keys,
                              audit=AuditLog.in_dir(fleet.state_dir),
                              ssl_context=None if is_loopback(fleet.interface) else host.api_tls_context())
    served.set_api_port(api.port)
    return api


async def async_advertise_api(fleet_id: str, api: RunningApi, interface: str, stack: contextlib.AsyncExitStack) -> None:
    """Publish the API over mDNS until ``stack`` closes; a network without multicast only loses
    the record (logged)."""
    advertiser = ApiAdvertiser()
    try:
        await advertiser.async_start(ApiAdvertisement(fleet_id, api.port, interface))
    except (ApiAdvertError, OSError, TimeoutError) as exc:
        log.warning("the OpenAI API is not advertised over mDNS (%s); agents still get its address with "
                    "their assignment", exc)
        return
    stack.push_async_callback(advertiser.async_close)


def write_service_file(state_dir: Path, data: dict[str, Any]) -> None:
    """``fleet-service.json`` (0600, replaced atomically): how a local console finds this service."""
    write_text_atomic(state_dir / SERVICE_FILE, json.dumps({"pid": os.getpid(), **data}, indent=1))


def remove_service_file(state_dir: Path) -> None:
    (state_dir / SERVICE_FILE).unlink(missing_ok=True)
