"""The OpenAI API as the security tests attack it: the real paged coordinator over the tiny 2-stage
export, served on loopback with a key and small limits."""

from __future__ import annotations

import asyncio
import contextlib

from engine.api.server import ApiSettings, async_run_api
from engine.generation.request import GenerationRequest

KEY = "sk-deskfleet-security-test"
POOL = 16 << 20  # the KV block pool: the tiny model's blocks are small, a few hundred fit
SETTINGS = ApiSettings(api_key=KEY, max_body_bytes=2 << 20, max_prompt_tokens=200, default_max_tokens=16,
                       max_tokens_limit=64, max_concurrent=8)


@contextlib.asynccontextmanager
async def served(tiny_export, settings: ApiSettings = SETTINGS, host: str = "127.0.0.1", tokenizer_type=None):
    """(coordinator, api) on this loop over the tiny 2-stage export, warmed up; ``tokenizer_type``:
    a ChatTokenizer subclass to serve with (one that records what it was given)."""
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator

    export = tiny_export("llama", 2)
    tokenizer = await asyncio.to_thread(tokenizer_type or ChatTokenizer, export / "tokenizer")
    async with BatchCoordinator.local(export, slots=4, kv_pool_bytes=POOL) as coordinator:
        async with contextlib.aclosing(coordinator.stream(GenerationRequest((1, 5, 9), 4))) as tokens:
            _ = [e async for e in tokens]
        api = await async_run_api(coordinator, tokenizer, settings, host)
        try:
            yield coordinator, api
        finally:
            await api.async_stop()
