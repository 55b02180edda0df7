"""``deskfleet models pull``: a model from the Hugging Face hub (or the mirror ``HF_ENDPOINT`` names)
into the hub's own cache, with ``huggingface_hub`` doing the transfer.

The library does the work a download needs: the hub's address from ``HF_ENDPOINT``, ``HF_TOKEN``
for gated models, proxies from the environment, retries that resume a cut transfer with a range
request, a progress bar, and a cache (``HF_HOME``) that other tools share. What is ours:

- **which files**: one GGUF (``--file NAME``, or ``--quant Q4_K_M`` naming exactly one) or an HF
  checkpoint (config, safetensors, tokenizer and template files; never PyTorch pickles);
- **room first**: the files' sizes, read from the hub's file list, against the free space of the
  cache's disk, before a byte is fetched;
- **verified after**: every file hashed against what the hub lists for it (the LFS sha256 for
  large files, the git blob id for small ones). A file that does not match is deleted from the
  cache, with its snapshot link, and the pull fails naming it: nothing half-written or wrong stays
  behind for a later pull (or export) to trust.

Nothing else in Deskfleet reaches the network. The library drops a partial file when its process
ends, so a pull interrupted by the user starts that file again next time.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import DeskfleetError

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger(__name__)

# The files of an HF checkpoint a Deskfleet export reads (weights as safetensors only).
CHECKPOINT_FILES = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer\.json|tokenizer_config\.json|tokenizer\.model|special_tokens_map\.json|vocab\.json"
    r"|merges\.txt|added_tokens\.json|chat_template\.jinja|chat_template\.json)$")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_HASH_CHUNK = 1 << 20
DISK_MARGIN_BYTES = 256 << 20  # left free after a pull: the export and the OS need room too


class PullError(DeskfleetError):
    """A pull cannot start or did not finish: no such repository or file, an ambiguous choice, too
    little disk, the hub unreachable, or a file that does not match its hash (deleted)."""


@dataclass(frozen=True)
class HubFile:
    """One file of a repository as the hub lists it. ``sha256`` is set for LFS files, ``blob_id``
    (the git object id: sha1 of ``blob <size>\\0`` + content) for the others."""

    name: str
    size: int
    sha256: str | None = None
    blob_id: str | None = None


@dataclass(frozen=True)
class PullPlan:
    """What a pull fetches: ``files`` of ``repo`` at ``revision`` (the commit the hub resolved)."""

    repo: str
    revision: str
    files: tuple[HubFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def is_gguf(self) -> bool:
        return len(self.files) == 1 and self.files[0].name.lower().endswith(".gguf")


def choose_files(files: Sequence[HubFile], *, file: str | None = None, quant: str | None = None,
                 repo: str = "the repository") -> tuple[HubFile, ...]:
    """The files a pull fetches (pure; see the module docstring), or PullError saying what to pass."""
    ggufs = [f for f in files if f.name.lower().endswith(".gguf")]
    if file is not None:
        chosen = [f for f in files if f.name == file]
        if not chosen:
            names = ", ".join(f.name for f in ggufs) or "none"
            raise PullError(f"{repo} has no file {file!r}; its GGUF files: {names}")
        if not file.lower().endswith(".gguf"):
            raise PullError(f"--file takes a GGUF file ({file!r} is not one); leave it out to pull the checkpoint")
        return _single_gguf(chosen[0])
    if quant is not None:
        wanted = quant.lower()
        chosen = [f for f in ggufs if re.search(rf"(^|[._-]){re.escape(wanted)}([._-]|$)", f.name.lower())]
        if len(chosen) != 1:
            found = "none" if not chosen else ", ".join(f.name for f in chosen)
            raise PullError(f"--quant {quant} names {len(chosen)} of {repo}'s GGUF files ({found}); the files "
                            f"are: {', '.join(f.name for f in ggufs) or 'none'}. Pass --file NAME")
        return _single_gguf(chosen[0])
    checkpoint = tuple(f for f in files if CHECKPOINT_FILES.match(f.name))
    if any(f.name.endswith(".safetensors") for f in checkpoint) and any(f.name == "config.json" for f in checkpoint):
        return checkpoint
    if ggufs:
        raise PullError(f"{repo} holds {len(ggufs)} GGUF file(s); choose one with --quant (e.g. "
                        f"{_quant_hint(ggufs)}) or --file NAME: {', '.join(f.name for f in ggufs)}")
    raise PullError(f"{repo} holds neither safetensors weights with a config.json nor a GGUF file "
                    "(PyTorch .bin checkpoints are not pulled: they can run code when loaded)")


def _single_gguf(f: HubFile) -> tuple[HubFile, ...]:
    if _SPLIT_GGUF.search(f.name):
        raise PullError(f"{f.name} is one part of a split GGUF; Deskfleet reads single-file GGUFs "
                        "(join the parts with llama.cpp's gguf-split --merge, then `deskfleet models add`)")
    return (f,)


def _quant_hint(ggufs: Iterable[HubFile]) -> str:
    for f in ggufs:
        match = re.search(r"(Q\d_K_[SML]|Q\d_K|Q\d_\d|IQ\d_\w+|F16|BF16|F32)", f.name, re.IGNORECASE)
        if match:
            return match.group(1)
    return "Q4_K_M"


def plan_pull(repo: str, *, file: str | None = None, quant: str | None = None, revision: str | None = None,
              api: HfApi | None = None) -> PullPlan:
    """Ask the hub what ``repo`` holds (its file list with sizes and hashes: bytes of metadata,
    not the weights) and choose the files."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    api = api or HfApi()
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except RepositoryNotFoundError as exc:
        raise PullError(f"no model {repo!r} on {api.endpoint} (or it is private: set HF_TOKEN to a token "
                        "that may read it)") from exc
    except RevisionNotFoundError as exc:
        raise PullError(f"{repo} has no revision {revision!r}") from exc
    except HfHubHTTPError as exc:
        raise PullError(f"the hub at {api.endpoint} refused to list {repo}: {exc}") from exc
    except OSError as exc:  # connection refused, DNS, proxy
        raise PullError(f"cannot reach the hub at {api.endpoint} ({exc}); a company mirror is named by "
                        "HF_ENDPOINT, a proxy by HTTPS_PROXY") from exc
    files = [HubFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0)),
                     s.lfs.sha256 if s.lfs else None, None if s.lfs else s.blob_id)
             for s in info.siblings or []]
    return PullPlan(repo, str(info.sha or revision or "main"), choose_files(files, file=file, quant=quant, repo=repo))


def check_room(plan: PullPlan, cache_dir: Path) -> None:
    """PullError unless ``cache_dir``'s disk has room for the plan's files not yet in the cache."""
    probe = cache_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    needed = plan.total_bytes + DISK_MARGIN_BYTES
    if needed > free:
        raise PullError(f"{plan.repo} needs {_gib(plan.total_bytes)} (+{_gib(DISK_MARGIN_BYTES)} kept free) "
                        f"but {probe} has {_gib(free)} free; free some space (`deskfleet models` lists what "
                        "is on this PC) or point HF_HOME at a bigger disk")


def pull(plan: PullPlan, *, cache_dir: Path | None = None, progress: bool = True, endpoint: str | None = None,
         on_file: Callable[[HubFile], None] | None = None) -> Path:
    """Fetch the plan's files into the hub cache and verify each; the GGUF's path, or the
    checkpoint's snapshot directory. ``endpoint`` overrides ``HF_ENDPOINT``."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    (enable_progress_bars if progress else disable_progress_bars)()
    check_room(plan, cache)
    paths: list[Path] = []
    for f in plan.files:
        if on_file is not None:
            on_file(f)
        try:
            local = Path(hf_hub_download(plan.repo, f.name, revision=plan.revision, cache_dir=cache,
                                         endpoint=endpoint))
        except HfHubHTTPError as exc:
            raise PullError(f"the hub refused {plan.repo}/{f.name}: {exc}") from exc
        except OSError as exc:
            raise PullError(f"fetching {plan.repo}/{f.name} failed ({exc}); run the same command again") from exc
        verify(local, f)
        paths.append(local)
    return paths[0] if plan.is_gguf else paths[0].parent


def verify(local: Path, f: HubFile) -> None:
    """PullError, after deleting the cached file and its snapshot link, unless ``local`` is the file
    the hub listed (size and hash)."""
    blob = local.resolve()
    size = blob.stat().st_size
    problem = None
    if size != f.size:
        problem = f"{size} bytes instead of {f.size}"
    elif f.sha256 is not None and _sha256(blob) != f.sha256.lower():
        problem = "its sha256 differs from the hub's"
    elif f.sha256 is None and f.blob_id is not None and _git_blob_id(blob, size) != f.blob_id.lower():
        problem = "its git blob id differs from the hub's"
    if problem is None:
        return
    for path in {local, blob}:
        path.unlink(missing_ok=True)
    raise PullError(f"{f.name} arrived damaged ({problem}); it was deleted. Run the same command again; if it "
                    "fails the same way, the mirror (HF_ENDPOINT) or a proxy is serving a different file")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_id(path: Path, size: int) -> str:
    h = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.1f} MiB"
