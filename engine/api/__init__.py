"""The OpenAI-compatible HTTP API over a Generator: schema, request hygiene, the aiohttp server."""
