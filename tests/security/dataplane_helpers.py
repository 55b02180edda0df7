"""Shared by the data-plane insider and bound tests: one fleet CA with the console, the desk
serving a stage and two fellow members, and the small helpers both files use."""

from __future__ import annotations

from engine.shards.manifest import load_manifest
from engine.trust.fleet_ca import Credentials, FleetAuthority, Role
from engine.wire.address import Address

N = 12  # tokens per test request
LOOP = Address("127.0.0.1", 0)


def make_fleet() -> dict[str, Credentials]:
    """The console, the desk serving the stage, and two fellow members (mallory, bob), one CA."""
    authority = FleetAuthority.create("insider test fleet")
    return {name: authority.issue_credentials(name, role=role) for name, role in
            (("console", Role.CONSOLE), ("desk", Role.AGENT), ("mallory", Role.AGENT), ("bob", Role.AGENT))}


def fp_of(export) -> str:
    """The model fingerprint a Hello to this export's stages must name."""
    return load_manifest(export).model.fingerprint
