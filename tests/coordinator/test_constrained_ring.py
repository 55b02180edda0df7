"""Constrained output and log-probabilities on the console's paged ring (issue 17): a real fleet
host, two real agents joined with tokens, a worker process per stage, mutual TLS; the masks and
the top-k travel the wire to the last stage and back. The ring's coordinator serves the features
(the API then stops refusing them) and its JSON is valid for the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from console.fleet.distribution import Distributor
from console.fleet.ring_layout import AgentTarget, RingLayout
from engine.control.messages import WorkerSettings
from engine.generation.request import FinishReason, GenerationRequest, JsonConstraint, SamplingParams
from tests.conftest import PROMPT_IDS
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import run
from tests.support.loopback import free_port

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": [1, 2, 3]}},
          "required": ["ok", "size"], "additionalProperties": False}

pytestmark = pytest.mark.usefixtures("private_keyring")


def test_the_console_ring_serves_schema_valid_json_with_logprobs(tiny_export, tmp_path):
    export = tiny_export("llama", 2)
    text = Tokenizer.from_file(str(export / "tokenizer" / "tokenizer.json"))
    constraint = JsonConstraint(json.dumps(SCHEMA), "flag", strict=True)

    async def main():
        async with console(tmp_path / "console") as con:
            agents = []
            try:
                for name in ("desk-a", "desk-b"):
                    agent = AgentService(tmp_path / name, AgentSettings(name=name, interface="127.0.0.1",
                                                                        control_port=0, data_port=0, kv_pool_mb=32),
                                         idle_source=FakeIdle(1e6), power=lambda: None)
                    agents.append(agent)
                    await agent.async_start()
                    await agent.async_join(con.enrollment, con.token())
                layout = RingLayout.of([AgentTarget(f"127.0.0.1:{a.control_port}", i, free_port(), a.settings.name)
                                        for i, a in enumerate(agents)])
                async with Distributor(con, export, layout, worker=WorkerSettings(threads=1, exact=True)) as dist:
                    assert (await dist.async_run()).ok
                    c = dist.coordinator
                    out = []
                    for seed in (None, 4):
                        sampling = SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed)
                        request = GenerationRequest(PROMPT_IDS, 60, sampling, logprobs=2, constraint=constraint)
                        out.append([e async for e in c.stream(request)])
                    return c.features, out
            finally:
                for agent in agents:
                    await agent.async_close()

    features, runs = run(main())
    assert features >= {"logprobs", "response_format", "forced_tool_call"}
    greedy, sampled = runs
    for events in runs:
        assert events[-1].finish is FinishReason.STOP
        jsonschema.validate(json.loads(text.decode([e.token_id for e in events])), SCHEMA)
        assert all(e.logprob is not None and e.logprob <= 0 and 1 <= len(e.top_logprobs) <= 2 for e in events)
    assert all(e.top_logprobs[0] == (e.token_id, e.logprob) for e in greedy)  # greedy: the chosen is the top-1
