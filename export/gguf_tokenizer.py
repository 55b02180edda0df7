"""A GGUF's tokenizer and chat template as HF tokenizer files, without torch or transformers.

The GGUF carries the whole tokenizer as metadata (``tokenizer.ggml.*``): the model type, the
vocabulary, BPE merges or SentencePiece scores, token types, special token ids, the
pre-tokenizer's name and the chat template. This module writes what
:class:`engine.generation.tokenizer.ChatTokenizer` and HF tools read:

    tokenizer.json          the `tokenizers` library's format
    tokenizer_config.json   special tokens and the chat template
    chat_template.jinja     the chat template
    generation_config.json  bos / eos / pad ids (eos: every end-of-generation id the GGUF names)

Supported, each written so it tokenizes as llama.cpp does with the same file:

- byte-level BPE (``tokenizer.ggml.model = gpt2``: Llama 3, Qwen 2/2.5/3, SmolLM, DeepSeek,
  GPT-4o-style, Mistral's tekken, ...) with a pre-tokenizer of :data:`export.gguf_pretokenizers.SPLITS`;
- SentencePiece BPE (``llama``: Llama 2, Mistral 7B, Gemma 1-3, ...): spaces as ``▁`` (one
  prepended to each run of text unless ``tokenizer.ggml.add_space_prefix`` is false), the
  scores as merge priority (the merge that makes the highest-scoring token first), characters
  outside the vocabulary as their ``<0xNN>`` byte tokens.

Token types: CONTROL and UNKNOWN tokens become special added tokens, USER_DEFINED ones plain
added tokens; both are matched whole in the raw text, as llama.cpp matches them. Anything else
raises :class:`GGUFTokenizerError` naming what is supported, before any work.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import DeskfleetError
from export.gguf_pretokenizers import SPLITS

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
_END_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")  # llama.cpp's end-of-generation ids
_SPM_DEFAULT_IDS = {"unk": 0, "bos": 1, "eos": 2}  # llama.cpp's for a SentencePiece file that names none
_SPACE = "\u2581"  # SentencePiece's visible space
_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}

class GGUFTokenizerError(DeskfleetError):
    """A GGUF's tokenizer cannot be written as HF tokenizer files (missing metadata or a
    tokenizer model / pre-tokenizer this converter does not support)."""


def supported() -> str:
    """What converts, in one sentence (for error messages and docs)."""
    return (f"byte-level BPE ('gpt2') with the pre-tokenizers {', '.join(sorted(SPLITS))}; "
            "and SentencePiece BPE ('llama')")


@dataclass(frozen=True)
class _Model:
    """The kind-specific part of tokenizer.json, and whether llama.cpp adds BOS by default."""

    model: dict[str, Any]
    normalizer: dict[str, Any] | None
    pre_tokenizer: dict[str, Any] | None
    decoder: dict[str, Any]
    adds_bos: bool


def check_tokenizer_kind(metadata: Mapping[str, Any]) -> tuple[str, str]:
    """The GGUF's tokenizer model and pre-tokenizer, or GGUFTokenizerError when this converter does not
    support them (read from the header alone: ``deskfleet models`` asks this of every GGUF it lists)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in _MODELS:
        raise GGUFTokenizerError(
            f"this GGUF's tokenizer is {kind!r}; supported: {supported()}. "
            "Use an HF checkpoint directory with its tokenizer.json instead")
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")
    if kind == "gpt2" and pre not in SPLITS:
        raise GGUFTokenizerError(
            f"this GGUF's pre-tokenizer {pre!r} is not supported; supported: {supported()}. "
            "Use an HF checkpoint directory with its tokenizer.json instead")
    return str(kind), pre


def tokenizer_files(metadata: Mapping[str, Any]) -> dict[str, str]:
    """File name -> text of the HF tokenizer files, from a GGUF's metadata (key -> plain value,
    as :attr:`export.weights.gguf_source.GGUFSource.metadata` holds it)."""
    meta = {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}
    kind, pre = check_tokenizer_kind(meta)
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFTokenizerError("this GGUF has no tokenizer vocabulary; it cannot be chatted with")
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)]
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"this GGUF lists {len(tokens)} tokens but {len(types)} token types")
    vocab = {text: i for i, text in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFTokenizerError("this GGUF's vocabulary lists a token twice; llama.cpp refuses it too")

    defaults = _SPM_DEFAULT_IDS if kind == "llama" else {}

    def token_id(key: str) -> int | None:
        index = meta.get(f"tokenizer.ggml.{_ID_KEYS[key]}", defaults.get(key))
        return int(index) if index is not None and 0 <= int(index) < len(tokens) else None

    def token(key: str) -> str | None:
        index = token_id(key)
        return None if index is None else tokens[index]

    if kind == "gpt2":
        built = _byte_level(meta, vocab, pre)
    else:
        built = _sentencepiece(meta, tokens, types, token("unk"))
    adds_bos = bool(meta.get("tokenizer.ggml.add_bos_token", built.adds_bos))
    adds_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if adds_bos and token("bos") is None:
        raise GGUFTokenizerError("this GGUF asks for a BOS token at the start of every text but names none")
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": types[i] != _USER_DEFINED}
            for i, text in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED, _UNKNOWN)
        ],
        "normalizer": built.normalizer,
        "pre_tokenizer": built.pre_tokenizer,
        "post_processor": _post_processor(token("bos") if adds_bos else None, token_id("bos"),
                                          token("eos") if adds_eos else None, token_id("eos")),
        "decoder": built.decoder,
        "model": built.model,
    }
    template = meta.get("tokenizer.chat_template")
    config: dict[str, Any] = {"add_bos_token": adds_bos, "add_eos_token": adds_eos,
                              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 60,
                              "tokenizer_class": "PreTrainedTokenizerFast"}
    for key in ("bos", "eos", "pad", "unk"):
        if token(key) is not None:
            config[f"{key}_token"] = token(key)
    if template:
        config["chat_template"] = template
    files = {
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "generation_config.json": json.dumps(_generation_config(meta, len(tokens), token_id), indent=2) + "\n",
    }
    if template:
        files["chat_template.jinja"] = template
    return files


def _byte_level(meta: Mapping[str, Any], vocab: dict[str, int], pre: str) -> _Model:
    merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    if not merges:
        raise GGUFTokenizerError("this GGUF's byte-level vocabulary has no merges; it cannot be chatted with")
    split = SPLITS[pre]
    return _Model(
        model={"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
               "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
               "ignore_merges": split.ignore_merges, "vocab": vocab, "merges": [_merge_pair(m) for m in merges]},
        normalizer=None,
        pre_tokenizer=split.pre_tokenizer(),
        decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        adds_bos=split.adds_bos,
    )


def _merge_pair(merge: str) -> list[str]:
    """``"a b"`` -> ``["a", "b"]``, split where llama.cpp splits it (the first space after the first character)."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise GGUFTokenizerError(f"this GGUF has a malformed merge {merge!r} (no space between two tokens)")
    return [merge[:cut], merge[cut + 1:]]


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], types: list[int], unk: str | None) -> _Model:
    """SentencePiece BPE as `tokenizers` BPE: the same merges, in the order of the scores."""
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    if len(scores) != len(tokens):
        raise GGUFTokenizerError(f"this GGUF lists {len(tokens)} tokens but {len(scores)} scores")
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
    normalizer = ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": _SPACE}, replace]}
                  if space_prefix else replace)
    decoders: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
                                      {"type": "ByteFallback"}, {"type": "Fuse"}]
    if space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    merges = sentencepiece_merges(tokens, types, scores)
    return _Model(
        model={"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
               "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
               "vocab": {text: i for i, text in enumerate(tokens)}, "merges": merges},
        normalizer=normalizer,
        pre_tokenizer=None,
        decoder={"type": "Sequence", "decoders": decoders},
        adds_bos=True,
    )


def sentencepiece_merges(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float]) -> list[list[str]]:
    """The BPE merges equivalent to SentencePiece's (and llama.cpp's) scores.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the
    highest-scoring token of the vocabulary (leftmost on a tie). As BPE merges: every split
    ``a + b`` of a token into two tokens, ranked by the joined token's score, highest first.
    Control, unknown and byte tokens are never the product of a merge (text cannot spell them).
    """
    mergeable = {text: i for i, text in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED, _UNUSED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for text, i in mergeable.items():
        for cut in range(1, len(text)):
            left = text[:cut]
            if left in mergeable and (right := text[cut:]) in mergeable:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [[left, right] for _, _, _, left, right in ranked]


def _post_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None) -> dict[str, Any]:
    """Adds BOS before (and EOS after) each sequence where the GGUF asks for them."""
    def sequence(name: str, type_id: int) -> list[dict]:
        head = [{"SpecialToken": {"id": bos, "type_id": type_id}}] if bos else []
        tail = [{"SpecialToken": {"id": eos, "type_id": type_id}}] if eos else []
        return [*head, {"Sequence": {"id": name, "type_id": type_id}}, *tail]

    special: dict[str, Any] = {}
    for text, index in ((bos, bos_id), (eos, eos_id)):
        if text is not None:
            special[text] = {"id": text, "ids": [index], "tokens": [text]}
    return {"type": "TemplateProcessing", "single": sequence("A", 0), "pair": [*sequence("A", 0), *sequence("B", 1)],
            "special_tokens": special}


def _generation_config(meta: Mapping[str, Any], n_tokens: int, token_id: Any) -> dict[str, Any]:
    """bos / eos / pad ids; eos lists every end-of-generation id the GGUF names (eos, end of turn,
    end of message: Llama 3's ``<|eot_id|>`` ends a chat answer, not ``<|end_of_text|>``)."""
    config = {f"{key}_token_id": token_id(key) for key in ("bos", "eos") if token_id(key) is not None}
    ends: list[int] = []
    for key in _END_KEYS:
        index = meta.get(f"tokenizer.ggml.{key}")
        if key == "eos_token_id":
            index = token_id("eos")
        if index is not None and 0 <= int(index) < n_tokens and int(index) not in ends:
            ends.append(int(index))
    if len(ends) > 1:
        config["eos_token_id"] = ends
    if token_id("pad") is not None:
        config["pad_token_id"] = token_id("pad")
    return config


def write_tokenizer_files(gguf_path: Path, out_dir: Path, metadata: Mapping[str, Any] | None = None) -> list[Path]:
    """Write the HF tokenizer files of ``gguf_path`` into ``out_dir``; return their paths.

    Pass the open source's ``metadata`` to avoid parsing the GGUF header a second time.
    """
    if metadata is None:
        # here: the GGUF reader loads only when no metadata was passed in
        from export.weights.gguf_file import GGUFFile

        metadata = GGUFFile(Path(gguf_path)).fields
    files = tokenizer_files(metadata)  # refuses before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
        written.append(out_dir / name)
    return written


def write_checkpoint_metadata(gguf_path: Path, out_dir: Path, source: Any = None) -> list[Path]:
    """config.json (HF-style, from the GGUF's metadata) plus the tokenizer files, into ``out_dir``.

    The torch-free replacement for converting a GGUF into a safetensors checkpoint: the stage
    builder reads the weights from the GGUF itself, so only what describes the model is written.
    """
    if source is None:
        # here: the GGUF reader loads only when no source was passed in
        from export.weights.gguf_source import GGUFSource

        source = GGUFSource(Path(gguf_path))
    out_dir = Path(out_dir)
    written = write_tokenizer_files(gguf_path, out_dir, metadata=source.metadata)
    config = dict(source.config)
    config.setdefault("torch_dtype", "float32")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [*written, out_dir / "config.json"]
