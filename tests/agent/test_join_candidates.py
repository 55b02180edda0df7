"""An agent joining through consoles found over mDNS tries them side by side, each within its own
short time (review L7): records anyone on the network can forge, pointing at addresses that accept
and never answer, cost one candidate's time, not the join's; a refusal by the fleet's own console
is final. Real sockets on loopback, a real console half, the real join."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from agent.service.fleet_link import async_join_first
from engine.control.enrollment import async_join
from engine.errors import EnrollmentError, JoinRefused
from tests.support.agent_helpers import console
from tests.support.asyncutil import run


@contextlib.asynccontextmanager
async def tarpits(n: int):
    """``n`` loopback listeners that accept connections and never say a word; yields their addresses."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader, writer) -> None:
        held.append(writer)

    servers = [await asyncio.start_server(hold, "127.0.0.1", 0) for _ in range(n)]
    try:
        yield [f"127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    finally:
        for writer in held:
            writer.close()
        for s in servers:
            s.close()
            await s.wait_closed()


def test_forged_records_at_silent_addresses_do_not_keep_the_real_console_from_being_tried(tmp_path,
                                                                                        private_keyring):
    async def main():
        async with console(tmp_path / "console") as con, tarpits(12) as silent:
            token = con.token()

            async def attempt(address: str, budget: float):
                return await async_join(address, token, "pc-1", timeout=budget)
            # the forged records first, the real console last; a join deadline the old way (each
            # candidate in turn with the rest of the deadline) spends whole on the first tarpit
            joined = await async_join_first([*silent, con.enrollment], attempt, 30.0, per_candidate_s=10.0)
            assert joined.credentials.fleet_id == con.authority.fleet_id

            with pytest.raises(EnrollmentError, match="none of the 3 consoles"):
                await async_join_first(silent[:3], attempt, 2.0, per_candidate_s=1.0)

            # the token is used up: the fleet's own console refuses it, which is final
            with pytest.raises(JoinRefused):
                await async_join_first([*silent, con.enrollment], attempt, 30.0, per_candidate_s=10.0)

    run(main(), timeout=120)
