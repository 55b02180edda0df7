"""A GGUF's tokenizer and chat template as HF tokenizer files, without torch or transformers.

The GGUF carries the whole tokenizer as metadata (``tokenizer.ggml.*``): the model type, the
vocabulary, the BPE merges, token types, special token ids and the pre-tokenizer's name. This
module writes what :class:`engine.generation.tokenizer.ChatTokenizer` and HF tools read:

    tokenizer.json          the `tokenizers` library's format (BPE, byte-level)
    tokenizer_config.json   special tokens and the chat template
    chat_template.jinja     the chat template
    generation_config.json  bos / eos / pad ids

Supported: byte-level BPE (``tokenizer.ggml.model = gpt2``) with the pre-tokenizers below; each
is llama.cpp's split written as the equivalent `tokenizers` pre-tokenizer. Others raise
:class:`GGUFTokenizerError` naming what is supported.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.errors import DeskfleetError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are special / added tokens
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}

# llama.cpp pre-tokenizer name -> the `tokenizers` pre-tokenizer that splits text the same way.
PRE_TOKENIZERS: dict[str, dict] = {
    # GPT-2's regex alone.
    "gpt2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
    # Every digit on its own ("\p{N}"), then GPT-2's regex (llama.cpp: SMOLLM, STARCODER, REFACT...).
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "starcoder": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
}


class GGUFTokenizerError(DeskfleetError):
    """A GGUF's tokenizer cannot be written as HF tokenizer files (missing metadata or a
    tokenizer model / pre-tokenizer this converter does not support)."""


def tokenizer_files(metadata: Mapping[str, Any]) -> dict[str, str]:
    """File name -> text of the HF tokenizer files, from a GGUF's metadata (key -> plain value,
    as :attr:`export.weights.gguf_source.GGUFSource.metadata` holds it)."""
    meta = {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFTokenizerError(
            f"this GGUF's tokenizer is {model!r}; only byte-level BPE ('gpt2') tokenizers convert without "
            "transformers. Use an HF checkpoint directory with its tokenizer.json instead")
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(
            f"this GGUF's pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))}); "
            "use an HF checkpoint directory with its tokenizer.json instead")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    if not tokens or not merges:
        raise GGUFTokenizerError("this GGUF has no tokenizer vocabulary or merges; it cannot be chatted with")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))

    def token_id(key: str) -> int | None:
        index = meta.get(f"tokenizer.ggml.{_ID_KEYS[key]}")
        return int(index) if index is not None and 0 <= int(index) < len(tokens) else None

    def token(key: str) -> str | None:
        index = token_id(key)
        return None if index is None else tokens[index]

    bos = token("bos")
    adds_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    added = [
        {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": types[i] != _CONTROL, "special": types[i] == _CONTROL}
        for i, text in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    single: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]
    special_tokens: dict = {}
    if adds_bos and bos is not None:
        bos_id = token_id("bos")
        single = [{"SpecialToken": {"id": bos, "type_id": 0}}, *single]
        pair = [{"SpecialToken": {"id": bos, "type_id": 0}}, pair[0],
                {"SpecialToken": {"id": bos, "type_id": 1}}, pair[1]]
        special_tokens = {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair,
                           "special_tokens": special_tokens},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {text: i for i, text in enumerate(tokens)},
            "merges": [merge.split(" ", 1) for merge in merges],
        },
    }
    template = meta.get("tokenizer.chat_template")
    config: dict[str, Any] = {"add_bos_token": adds_bos,
                              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 60,
                              "tokenizer_class": "PreTrainedTokenizerFast"}
    for key in ("bos", "eos", "pad", "unk"):
        if token(key) is not None:
            config[f"{key}_token"] = token(key)
    if template:
        config["chat_template"] = template
    generation = {f"{key}_token_id": token_id(key) for key in ("bos", "eos", "pad") if token_id(key) is not None}
    files = {
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }
    if template:
        files["chat_template.jinja"] = template
    return files


def write_tokenizer_files(gguf_path: Path, out_dir: Path, metadata: Mapping[str, Any] | None = None) -> list[Path]:
    """Write the HF tokenizer files of ``gguf_path`` into ``out_dir``; return their paths.

    Pass the open source's ``metadata`` to avoid parsing the GGUF header a second time.
    """
    if metadata is None:
        from export.weights.gguf_file import GGUFFile

        metadata = GGUFFile(Path(gguf_path)).fields
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in tokenizer_files(metadata).items():
        (out_dir / name).write_text(text, encoding="utf-8")
        written.append(out_dir / name)
    return written


def write_checkpoint_metadata(gguf_path: Path, out_dir: Path, source: Any = None) -> list[Path]:
    """config.json (HF-style, from the GGUF's metadata) plus the tokenizer files, into ``out_dir``.

    The torch-free replacement for converting a GGUF into a safetensors checkpoint: the stage
    builder reads the weights from the GGUF itself, so only what describes the model is written.
    """
    if source is None:
        from export.weights.gguf_source import GGUFSource

        source = GGUFSource(Path(gguf_path))
    out_dir = Path(out_dir)
    written = write_tokenizer_files(gguf_path, out_dir, metadata=source.metadata)
    config = dict(source.config)
    config.setdefault("torch_dtype", "float32")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [*written, out_dir / "config.json"]
