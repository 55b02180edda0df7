"""Two local fleets (worker processes on loopback) of the tiny llama behind one router and the real
API (``deskfleet serve --workers --rings 2``): 8 users at once through the `openai` client, both
rings used, every answer the solo greedy run; /health lists both rings; the ring count is checked."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from engine.errors import DeskfleetError
from engine.shards.manifest import load_manifest
from engine.tools.local_rings import local_rings, ring_ids
from tests.api.test_api import parse_prometheus
from tests.api.test_router import KEY, PROMPTS, greedy, scrape
from tests.support.api_helpers import serve_process
from tests.support.asyncutil import run

N = 10


@pytest.mark.slow
def test_serve_two_local_rings_to_eight_users_identically(tiny_export, unsplit_greedy):
    """``deskfleet serve --workers --rings 2``: two fleets of worker processes behind one API."""
    from engine.generation.tokenizer import ChatTokenizer

    export = tiny_export("llama", 2)
    tokenizer = ChatTokenizer(export / "tokenizer")
    eos = load_manifest(export).model.eos_token_ids
    args = ("--shards", str(export), "--workers", "--rings", "2", "--exact", "--kv-pool-mb", "16", "--slots", "8",
            "--api-key-env", "DESKFLEET_TEST_KEY")
    with serve_process(*args, env={"DESKFLEET_TEST_KEY": KEY}) as url:
        with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id

            def ask(prompt):
                answer = client.completions.create(model=model, prompt=list(prompt), max_tokens=N, temperature=0)
                return answer.choices[0].text

            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                texts = list(pool.map(ask, PROMPTS))
        metrics = parse_prometheus(scrape(url, "/metrics")[1])
        status, health = scrape(url, "/health")

    assert texts == [tokenizer.decode(greedy(unsplit_greedy, p, N, eos)) for p in PROMPTS]
    per_ring = {r: metrics[f'deskfleet_router_requests_total{{model="{model}",ring="{r}"}}'] for r in ring_ids(2)}
    assert sum(per_ring.values()) == len(PROMPTS) and min(per_ring.values()) >= 2, per_ring
    assert status == 200 and [r["ring"] for r in health["rings"]] == list(ring_ids(2))
    assert {r["status"] for r in health["rings"]} == {"ok"} and health["status"] == "ok"


def test_the_ring_count_is_checked(tiny_export):
    async def main():
        async with local_rings(tiny_export("llama", 1), 0):
            pass

    with pytest.raises(DeskfleetError, match="--rings must be between 1 and"):
        run(main())


def test_every_local_ring_constrains_output_with_its_exports_vocabulary(tiny_export):
    """local_rings (and so paged_local_fleet, which serve --workers runs) give each ring's
    coordinator the export's grammar vocabulary: schemas and forced tool calls are served, not 400."""
    from engine.paged.constraints import GRAMMAR_FEATURES, LOGPROBS

    export = tiny_export("llama", 2)

    async def main():
        async with local_rings(export, 1, model_name="llama") as router:
            return [ring.features for ring in router.rings().values()]

    (features,) = run(main())
    assert GRAMMAR_FEATURES | {LOGPROBS} <= features
