"""Models already on this PC in other tools' stores: Ollama, LM Studio and the Hugging Face cache.

Each store is read where its tool keeps it, without copying anything:

- **Ollama**: ``$OLLAMA_MODELS`` or ``~/.ollama/models`` (and the Linux service's
  ``/usr/share/ollama/.ollama/models``): ``manifests/<registry>/<namespace>/<model>/<tag>`` is a
  JSON manifest whose layer of media type ``application/vnd.ollama.image.model`` names the GGUF
  blob ``blobs/sha256-<hex>``. Named ``model:tag`` (``namespace/model:tag`` outside ``library``).
- **LM Studio**: ``~/.lmstudio/models`` and ``~/.cache/lm-studio/models``,
  ``<publisher>/<repository>/<file>.gguf``.
- **Hugging Face cache**: ``huggingface_hub.scan_cache_dir`` (``HF_HOME``): every snapshot that is
  an HF checkpoint (config.json + safetensors), and every GGUF in one.

For each, :func:`servable` reads only the GGUF header or config.json and says whether this fleet
can export it (and if not, why). ``ollama:NAME``-style references resolve with :func:`resolve_ref`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine.errors import DeskfleetError

if TYPE_CHECKING:
    from export.weights.gguf_file import GGUFFile, TensorInfo

log = logging.getLogger(__name__)

Store = Literal["ollama", "lmstudio", "hf-cache"]
STORES: tuple[Store, ...] = ("ollama", "lmstudio", "hf-cache")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
MAX_MANIFEST_BYTES = 1 << 20
MAX_FOUND = 1000  # per store: a listing, not a crawl


class StoreRefError(DeskfleetError):
    """A store reference (``ollama:NAME``, ``lmstudio:NAME``, ``hf:REPO``) names nothing on this PC."""


@dataclass(frozen=True)
class StoredModel:
    """One model found in a store. ``path`` is a GGUF file or a checkpoint directory; ``problem``
    is None when this fleet can export it, else why not (one sentence)."""

    store: Store
    name: str
    path: Path
    kind: Literal["gguf", "hf"]
    size_bytes: int
    quant: str
    problem: str | None

    @property
    def ref(self) -> str:
        return f"{_PREFIX[self.store]}:{self.name}"


_PREFIX: dict[Store, str] = {"ollama": "ollama", "lmstudio": "lmstudio", "hf-cache": "hf"}


def default_roots(env: Mapping[str, str] | None = None, home: Path | None = None) -> dict[Store, list[Path]]:
    """Where each store lives on this PC (existing or not)."""
    env = os.environ if env is None else env
    home = Path.home() if home is None else home
    ollama = [Path(env["OLLAMA_MODELS"])] if env.get("OLLAMA_MODELS") else [
        home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    lmstudio = [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
    hf_home = Path(env["HF_HOME"]) if env.get("HF_HOME") else home / ".cache" / "huggingface"
    hf = [Path(env["HF_HUB_CACHE"])] if env.get("HF_HUB_CACHE") else [hf_home / "hub"]
    return {"ollama": ollama, "lmstudio": lmstudio, "hf-cache": hf}


def find_models(roots: Mapping[Store, Iterable[Path]] | None = None) -> list[StoredModel]:
    """Every model in the stores under ``roots`` (default: :func:`default_roots`), store by store."""
    roots = default_roots() if roots is None else roots
    found: list[StoredModel] = []
    for store in STORES:
        seen: set[str] = set()  # two roots may be one folder (a link); one blob may have two names
        for root in roots.get(store, ()):
            for model in _SCANNERS[store](Path(root)):
                if model.name not in seen and len(seen) < MAX_FOUND:
                    seen.add(model.name)
                    found.append(model)
    return found


def resolve_ref(ref: str, roots: Mapping[Store, Iterable[Path]] | None = None) -> StoredModel:
    """The model ``ollama:NAME[:TAG]``, ``lmstudio:PUBLISHER/REPO/FILE`` or ``hf:REPO[/FILE]`` names."""
    prefix, _, name = ref.partition(":")
    stores = [s for s, p in _PREFIX.items() if p == prefix]
    if not stores or not name:
        raise StoreRefError(f"{ref!r} is not a store reference; say ollama:NAME, lmstudio:NAME or hf:REPO")
    if stores[0] == "ollama" and ":" not in name:
        name += ":latest"
    candidates = [m for m in find_models(roots) if m.store == stores[0]]
    matches = [m for m in candidates if m.name == name]
    if len(matches) != 1:
        known = ", ".join(m.name for m in candidates[:12]) or "none"
        raise StoreRefError(f"{ref} names {len(matches)} models in {stores[0]}'s store on this PC (found: {known})")
    return matches[0]


# -- stores ------------------------------------------------------------------------------------


def _ollama(root: Path) -> Iterable[StoredModel]:
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
        parts = manifest.relative_to(manifests).parts  # registry, namespace, model, tag
        if len(parts) != 4:
            continue
        _, namespace, model, tag = parts
        try:
            if manifest.stat().st_size > MAX_MANIFEST_BYTES:
                continue
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
        except (OSError, ValueError, AttributeError):
            log.warning("ollama manifest %s is not readable JSON; skipped", manifest)
            continue
        digests = [str(layer.get("digest", "")) for layer in layers
                   if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER]
        if len(digests) != 1 or not digests[0].startswith("sha256:"):
            continue
        blob = root / "blobs" / digests[0].replace(":", "-")
        if not blob.is_file():
            continue
        name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
        yield _gguf_model("ollama", name, blob)


def _lmstudio(root: Path) -> Iterable[StoredModel]:
    if not root.is_dir():
        return
    for gguf in sorted(root.glob("*/*/*.gguf")):
        yield _gguf_model("lmstudio", "/".join(gguf.relative_to(root).parts), gguf)


def _hf_cache(root: Path) -> Iterable[StoredModel]:
    if not root.is_dir():
        return
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(root)
    except CacheNotFound:
        return
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)[:1]:
            snapshot = Path(revision.snapshot_path)
            if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
                yield _checkpoint_model(repo.repo_id, snapshot)
            for gguf in sorted(snapshot.glob("*.gguf")):
                yield _gguf_model("hf-cache", f"{repo.repo_id}/{gguf.name}", gguf)


_SCANNERS = {"ollama": _ollama, "lmstudio": _lmstudio, "hf-cache": _hf_cache}


# -- what can be served ------------------------------------------------------------------------


def _gguf_model(store: Store, name: str, path: Path) -> StoredModel:
    size = path.stat().st_size
    try:
        header = _gguf_header(path)
    except (OSError, ValueError) as exc:
        return StoredModel(store, name, path, "gguf", size, "?", f"not a readable GGUF ({exc})")
    return StoredModel(store, name, path, "gguf", size, gguf_quant(header.fields, path.name, header.tensors),
                       servable_gguf(header.fields))


def _checkpoint_model(name: str, directory: Path) -> StoredModel:
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return StoredModel("hf-cache", name, directory, "hf", size, "?", f"config.json unreadable ({exc})")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "?")
    return StoredModel("hf-cache", name, directory, "hf", size, dtype, servable_config(config))


def _gguf_header(path: Path) -> GGUFFile:
    from export.weights.gguf_file import GGUFFile, GGUFFormatError

    try:
        return GGUFFile(path)
    except GGUFFormatError as exc:
        raise ValueError(str(exc)) from exc


def gguf_quant(fields: Mapping[str, Any], file_name: str = "", tensors: Iterable[TensorInfo] = ()) -> str:
    """The quantisation llama.cpp recorded (``general.file_type``, e.g. ``Q4_K_M``); else one in the
    file's name; else the type most of the matrices' bytes are stored in."""
    import collections

    import gguf

    try:
        return gguf.LlamaFileType(int(fields["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError, TypeError):
        pass
    stem = file_name.upper()
    for token in ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "BF16", "F16", "F32"):
        if token in stem:
            return token
    by_type: collections.Counter[int] = collections.Counter()
    for tensor in tensors:
        if len(tensor.dims) >= 2:
            by_type[tensor.type_id] += tensor.nbytes
    if not by_type:
        return "?"
    return gguf.GGMLQuantizationType(by_type.most_common(1)[0][0]).name


def servable_gguf(fields: Mapping[str, Any]) -> str | None:
    """None when this fleet exports a GGUF with this header, else why not."""
    from export.builder.refused import refusal
    from export.gguf_tokenizer import GGUFTokenizerError, check_tokenizer_kind
    from export.weights.gguf_source import GGUF_ARCHITECTURES

    arch = str(fields.get("general.architecture", "?"))
    if (why := refusal(arch)) is not None:
        return why
    if arch not in GGUF_ARCHITECTURES:
        return f"architecture {arch!r} is not supported (supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
    try:
        check_tokenizer_kind(fields)
    except GGUFTokenizerError as exc:
        return str(exc)
    return None


def servable_config(config: Mapping[str, Any]) -> str | None:
    """None when this fleet exports a checkpoint with this config.json, else why not."""
    from export.builder.families import FAMILIES
    from export.builder.refused import refusal

    model_type = str(config.get("model_type", "?"))
    if (why := refusal(model_type)) is not None:
        return why
    if model_type not in FAMILIES:
        return f"model type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
    return None
