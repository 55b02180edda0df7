"""Tokenizer and chat template for the coordinator, without transformers.

Uses the ``tokenizers`` library on the export's ``tokenizer.json`` and renders the model's
Jinja chat template in a sandbox, the way HF's ``apply_chat_template`` does (the rendered text
already holds the special tokens, so it is encoded without adding more). A template that takes
``tools`` (:attr:`ChatTokenizer.takes_tools`) gets them; for one that does not, the API describes
them in the conversation itself (:mod:`engine.generation.tool_calls`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.errors import TokenizerError
from engine.generation.reasoning import markers_for

Message = dict[str, Any]  # role, content; tool_calls, tool_call_id and name where a template takes tools


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_DECODER = _byte_decoder()
METASPACE = "\u2581"  # how SentencePiece writes a space


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
        # Whether the template reads a ``tools`` variable (HF's convention for tool-calling templates).
        # The variables the template reads: ``tools`` (HF's convention for tool-calling templates),
        # and the thinking switches ``enable_thinking`` / ``reasoning_effort`` (engine.generation.reasoning).
        self.template_variables: frozenset[str] = frozenset(
            meta.find_undeclared_variables(env.parse(template)) if isinstance(template, str) else ())
        self.takes_tools = "tools" in self.template_variables
        self.thinking = markers_for(template if isinstance(template, str) else None)
        decoder = json.loads(tok_file.read_text(encoding="utf-8")).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        # SentencePiece-style vocabularies write a space as U+2581 and their decoder drops the
        # first one of a text: a token's own bytes keep it.
        steps = decoder.get("decoders") or [decoder]
        self._metaspace = any(d.get("type") == "Metaspace" or (
            d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == METASPACE)
            for d in steps if isinstance(d, dict))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character for some byte-level tokens);
        empty for a special token."""
        piece = self._tok.id_to_token(token_id)
        if piece is None or piece in self._special.values():
            return b""
        if self._byte_level and all(c in BYTE_DECODER for c in piece):
            return bytes(BYTE_DECODER[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        if self._metaspace:
            return piece.replace(METASPACE, " ").encode("utf-8")
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None,
                    switches: Mapping[str, object] | None = None) -> str:
        """The conversation as the model's template writes it; ``tools`` (OpenAI function entries)
        only for a template that :attr:`takes_tools`; ``switches``: more template variables (the
        thinking switches of :func:`engine.generation.reasoning.template_switches`)."""
        if self._compiled is None:
            raise TokenizerError("this model has no chat template; send a plain completion prompt instead")
        if tools and not self.takes_tools:
            raise TokenizerError("this model's chat template does not take tools; describe them in the "
                                 "conversation (engine.generation.tool_calls.conversation)")
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        extra.update(switches or {})
        try:
            return self._compiled.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **extra, **self._special
            )
        except TemplateError as exc:
            raise TokenizerError(f"the chat template failed to render: {exc}") from exc

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None,
                    switches: Mapping[str, object] | None = None) -> list[int]:
        """Token ids of a conversation, ready for prefill."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, switches),
                           add_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
