"""Tokenizer and chat template for the coordinator, without transformers.

Uses the ``tokenizers`` library on the export's ``tokenizer.json`` and renders the model's
Jinja chat template in a sandbox, the way HF's ``apply_chat_template`` does (the rendered text
already holds the special tokens, so it is encoded without adding more).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.errors import TokenizerError

Message = dict[str, str]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise TokenizerError(f"the chat template refused the conversation: {message}")


class ChatTokenizer:
    """Encode/decode text and render conversations with the model's chat template."""

    def __init__(self, tokenizer_dir: Path | str):
        root = Path(tokenizer_dir)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{root} has no tokenizer.json; re-export the model with its tokenizer")
        try:
            self._tok = Tokenizer.from_file(str(tok_file))
            config_file = root / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own Exception type
            raise TokenizerError(f"cannot load the tokenizer in {root}: {exc}") from exc
        template = config.get("chat_template")
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self._special = {
            k: _token_text(v) for k, v in config.items() if k.endswith("_token") and _token_text(v) is not None
        }
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._compiled = env.from_string(template) if template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        if self._compiled is None:
            raise TokenizerError("this model has no chat template; send a plain completion prompt instead")
        try:
            return self._compiled.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self._special
            )
        except TemplateError as exc:
            raise TokenizerError(f"the chat template failed to render: {exc}") from exc

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation, ready for prefill."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
