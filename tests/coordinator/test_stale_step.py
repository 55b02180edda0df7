"""A step still in flight when the ring failed over can reach a stage that no longer holds (or
never held) its stream. Computed on empty state it gave garbage, and with one inference thread
OpenVINO then answered empty tensors for every stream of that stage; the worker now refuses such
a step (UNKNOWN_STREAM) and keeps serving everyone else exactly."""

from __future__ import annotations

import asyncio

import numpy as np

from engine.generation.in_process import greedy_generate
from engine.generation.request import GenerationRequest
from engine.shards.manifest import load_manifest
from engine.shards.stage import LocalChain
from engine.tools.local_fleet import local_fleet
from engine.wire.format import Role, StreamId
from engine.wire.messages import Forward, Hello
from engine.wire.transport import async_connect
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect, run

N = 12


def test_a_stale_step_of_an_unknown_stream_is_refused_and_the_stage_keeps_serving(tiny_export):
    export = tiny_export("llama", 2)
    unsplit = greedy_generate(LocalChain.load(tiny_export("llama", 1), exact=True), PROMPT_IDS, N,
                              ignore_eos=True).tokens
    fingerprint = load_manifest(export).model.fingerprint

    async def main():
        async with local_fleet(export, exact=True, threads=1) as c:
            first = c.path.first_remote
            conn = await async_connect(first.host, first.port, Hello(fingerprint, 0, Role.COORDINATOR))
            # decode step 21 of stream 77, which this ring never started
            await conn.async_send(Forward(StreamId(77), 9, np.array([[5]], dtype=np.int64),
                                          np.ones((1, 21), dtype=np.int64), np.array([[20]], dtype=np.int64)))
            await asyncio.sleep(1.0)
            tokens = await asyncio.wait_for(collect(c, GenerationRequest(PROMPT_IDS, N, ignore_eos=True)), 60)
            await conn.async_close()
            return tokens

    assert tuple(run(main())) == unsplit
