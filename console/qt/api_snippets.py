"""What the console shows an API user (no Qt): a key masked for the screen, and a curl and a
Python snippet with the fleet's real API address, key and model id, ready to copy and run."""

from __future__ import annotations

import json
import shlex

from engine.trust.key_book import KEY_PREFIX

SHOWN = 4  # characters of a key's end left visible when it is masked
PROMPT = "Say hello in one sentence."


def mask_key(key: str) -> str:
    """``sk-deskfleet-••••••••••••abcd``: the key's kind (its prefix) and its last `SHOWN`
    characters, the secret between them hidden."""
    if len(key) <= 2 * SHOWN:
        return "•" * len(key)
    cut = len(KEY_PREFIX) if key.startswith(KEY_PREFIX) else 0
    return f"{key[:cut]}{'•' * 12}{key[-SHOWN:]}"


def curl_snippet(api_url: str, key: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}]})
    return (f"curl {shlex.quote(api_url.rstrip('/') + '/chat/completions')} \\\n"
            f"  -H {shlex.quote('Authorization: Bearer ' + key)} \\\n"
            f"  -H 'Content-Type: application/json' \\\n"
            f"  -d {shlex.quote(body)}")


def python_snippet(api_url: str, key: str, model: str) -> str:
    return ("from openai import OpenAI  # pip install openai\n\n"
            f"client = OpenAI(base_url={api_url.rstrip('/')!r}, api_key={key!r})\n"
            f"reply = client.chat.completions.create(model={model!r}, messages=[{{\"role\": \"user\", "
            f"\"content\": {PROMPT!r}}}])\n"
            "print(reply.choices[0].message.content)")
