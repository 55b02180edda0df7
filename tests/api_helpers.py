"""A byte-level tokenizer, a model card and limits shared by the OpenAI schema and API tests."""

from __future__ import annotations

from engine.api import ApiSettings
from engine.generator import ModelCard

EOS = 256
CARD = ModelCard("fake", 64, (EOS,), 3)
SETTINGS = ApiSettings(max_prompt_tokens=40, default_max_tokens=20, max_tokens_limit=50)


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes, 256 is EOS (special: skipped when decoding)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
