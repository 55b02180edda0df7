"""A GGUF dequantised into an HF fp32 safetensors checkpoint, through transformers (torch).

The product never needs this: ``deskfleet export`` (CPU/GPU) reads a GGUF's tensors itself. Two
things still want a safetensors checkpoint of a GGUF: the traced NPU export (the export-npu
extra brings torch and transformers) and the optimum reference of the benchmarks. Converted
checkpoints are cached apart from the model directories ``deskfleet models`` lists::

    <cache root>/hf-checkpoints/<gguf stem>-<first 12 hex of the GGUF's sha256>/
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from engine.errors import MissingExtraError
from export.sources import (
    _PARTIAL_MARK,
    _SHORT_SHA,
    ModelSourceError,
    _embed_chat_template,
    _gguf_sha256,
    default_cache_root,
    gguf_of,
)

log = logging.getLogger(__name__)
HF_SUBDIR = "hf-checkpoints"


def hf_checkpoint(model: Path, *, cache_root: Path | None = None) -> Path:
    """An HF safetensors checkpoint directory for ``model``: itself when it is one, else the
    (cached) transformers conversion of its GGUF (a ``.gguf`` path or a model directory
    prepared from one)."""
    model = Path(model)
    if model.is_dir() and any(model.glob("*.safetensors")):
        return model
    gguf = model if model.is_file() else gguf_of(model)
    if gguf is None:
        raise ModelSourceError(f"{model} is neither an HF checkpoint directory nor backed by a GGUF file")
    gguf = gguf.resolve()
    root = cache_root if cache_root is not None else default_cache_root()
    final = root / HF_SUBDIR / f"{gguf.stem}-{_gguf_sha256(gguf)[:_SHORT_SHA]}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    log.info("Converting %s into a safetensors checkpoint at %s through transformers (once)...", gguf.name, final)
    partial = Path(tempfile.mkdtemp(prefix=f".{final.name}{_PARTIAL_MARK}", dir=final.parent))
    try:
        _write_hf_checkpoint(gguf, partial)
        try:
            partial.replace(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final


def _write_hf_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    try:
        import gguf  # noqa: F401 - transformers needs it to read GGUF files
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise MissingExtraError(
            f"Converting a GGUF into safetensors needs torch and transformers ({exc}). Install them "
            "with: pip install 'deskfleet[export-npu]'"
        ) from exc
    directory, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError, NotImplementedError) as exc:
        raise ModelSourceError(
            f"transformers could not load {gguf_path} ({exc}); convert the model to an HF "
            "checkpoint elsewhere and pass that directory."
        ) from exc
    # The weights are already dequantised to fp32; what remains is the GGUF quantizer marker,
    # which makes save_pretrained refuse and would tell loaders to look for a .gguf file.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _embed_chat_template(out_dir)
