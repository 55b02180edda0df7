"""The shard manifest: what an export produced, and the check that files still match it.

An export directory looks like::

    out/
      manifest.json
      tokenizer/            tokenizer.json, tokenizer_config.json, ...
      stage_0/              openvino_model.xml + .bin (embedding + layers 0..k)
      stage_1/              ...                        (layers k+1..L-1 + norm + head)

``manifest.json`` records every file with its size and sha256. Nothing is compiled until the
files a stage needs have been verified against it.

Two targets share the format. ``stateful`` shards (CPU/GPU) are one dynamic-shape graph per
stage that keeps its KV cache in device state. ``npu`` shards are static and stateless: each
stage has one or more fixed-shape graphs (``decode``, ``prefill``, ``packed``) whose KV travels
through explicit inputs/outputs from a host ring of ``static.context - rows`` positions.
Format version 2 added the target; a stateful export is still written as version 1, so
older Deskfleet builds keep reading it, while an NPU export is version 2, which they refuse
rather than misread as a stateful shard. A mixture-of-experts export also records each stage's
experts (``moe``, :class:`StageMoe`) in the same version: older builds ignore the key, and a
manifest without it reads as dense.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from engine.errors import ManifestError, ShardIntegrityError

FORMAT_VERSION = 2  # the newest format this build reads and writes
SUPPORTED_VERSIONS = (1, 2)
TARGETS = ("stateful", "npu")
# The runtime that serves an export of each target: a CPU/GPU (stateful-target) export paged (its
# stages converted to PagedAttention at load), an NPU-target export static (packed slots).
SERVING_RUNTIMES = {"stateful": "paged", "npu": "static"}
GRAPH_KINDS = ("decode", "prefill", "packed")
MASK_KINDS = ("2d", "4d")
MANIFEST_NAME = "manifest.json"
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of an export, relative to the export directory (POSIX separators)."""

    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output; -1 marks a dynamic dimension."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    fingerprint: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class WeightInfo:
    """How weights were compressed. ``format`` is one of int4, int8, fp16, fp32."""

    format: str
    group_size: int | None = None
    symmetric: bool = True


@dataclass(frozen=True)
class GraphEntry:
    """One static graph of an NPU stage.

    ``rows`` is its sequence length S (1 for decode, the chunk C for prefill, the slot count for
    packed). ``mask`` "2d" takes ``attention_mask`` int64 [1, W + S] shared by all rows (causal
    among the S new positions is built in); "4d" takes ``attention_bias`` float32
    [1, 1, S, W + S], one additive row per query row, written by the host.
    """

    name: str
    xml: str
    rows: int
    mask: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)


@dataclass(frozen=True)
class StaticInfo:
    """What an NPU export fixed at export time.

    ``context`` T is the attention length of the decode (or packed) graph: the host ring holds
    ``window`` = T - rows past positions per stage, shared byte for byte by the prefill graph.
    ``slots`` > 1 means the packed graph, whose window is split into ``slots`` equal regions.
    """

    context: int
    slots: int = 1
    prefill_chunk: int | None = None

    @property
    def rows(self) -> int:
        """Query rows of the main graph: the slot count (1 when unpacked)."""
        return self.slots

    @property
    def window(self) -> int:
        return self.context - self.rows


@dataclass(frozen=True)
class StageMoe:
    """A mixture-of-experts stage as placement prices it (an export of a MoE model writes one per
    stage; an older manifest, or a dense model, has none and reads as dense).

    Each of ``experts`` (E) experts is one slice of the stage's stacked expert weights, and a token
    runs ``per_token`` (k) of them: the runtime reads only the routed experts' slices, while every
    other weight (``dense_bytes``: attention, router, dense MLPs, norms, embedding, head) is read
    whole. ``expert_bytes`` + ``dense_bytes`` is the stage's weight file; memory holds all of it.
    """

    experts: int
    per_token: int
    expert_bytes: int
    dense_bytes: int

    def __post_init__(self) -> None:
        if not (0 < self.per_token <= self.experts and self.expert_bytes >= 0 and self.dense_bytes >= 0):
            raise ManifestError(f"manifest: inconsistent mixture-of-experts entry {self}; re-export the model")


@dataclass(frozen=True)
class StageManifest:
    index: int
    first_layer: int
    last_layer: int  # inclusive
    has_embedding: bool
    has_head: bool
    directory: str
    xml: str
    files: tuple[FileEntry, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    beam_idx: bool
    kv_cache_precision: str
    estimated_memory_bytes: int
    graphs: tuple[GraphEntry, ...] = ()  # NPU target only; ``xml`` then names the main graph
    moe: StageMoe | None = None  # a mixture-of-experts model's stage (None: dense)

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def activation_input_width(self) -> int | None:
        """Columns of the activation a later stage takes ([B, S, W]; None on stage 0 or when not
        static): the hidden size, or more where the model carries tensors across the cut (Gemma 4's
        per-layer embeddings and shared K/V, export.builder.gemma4_graph)."""
        dims = self.inputs[0].shape if self.inputs and not self.has_embedding else ()
        return dims[-1] if len(dims) == 3 and dims[-1] > 0 else None

    def graph(self, name: str) -> GraphEntry:
        """The static graph called ``name``; a clear error when this stage has none."""
        for g in self.graphs:
            if g.name == name:
                return g
        have = ", ".join(g.name for g in self.graphs) or "none (a stateful shard)"
        raise ManifestError(f"stage {self.index} has no {name!r} graph (it has {have}); "
                            "re-export with the options that produce it")


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model: ModelInfo
    weights: WeightInfo
    stages: tuple[StageManifest, ...]
    tokenizer_files: tuple[FileEntry, ...]
    exporter: str
    created: str
    extra: dict[str, Any] = field(default_factory=dict)
    target: str = "stateful"
    static: StaticInfo | None = None  # set exactly when target == "npu"

    @property
    def splits(self) -> tuple[int, ...]:
        """First layer of every stage after the first (the ``--split`` that made this export)."""
        return tuple(s.first_layer for s in self.stages[1:])

    @property
    def activation_width(self) -> int:
        """The widest activation passed from one stage to the next (what frames must hold)."""
        return max([self.model.hidden_size, *(s.activation_input_width or 0 for s in self.stages)])

    @property
    def moe(self) -> StageMoe | None:
        """The first stage's MoE entry (E and k are the model's), None for a dense model."""
        return next((s.moe for s in self.stages if s.moe is not None), None)

    def to_json(self) -> str:
        data = asdict(self)
        for stage in data["stages"]:  # a dense stage's manifest stays as before MoE existed
            if stage["moe"] is None:
                del stage["moe"]
        return json.dumps(data, indent=2, sort_keys=False) + "\n"


def format_version_for(target: str) -> int:
    """The oldest format that can describe an export for ``target`` (see the module docstring)."""
    return 1 if target == "stateful" else FORMAT_VERSION


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(root: Path, path: Path) -> FileEntry:
    rel = path.relative_to(root).as_posix()
    return FileEntry(path=rel, sha256=sha256_file(path), size=path.stat().st_size)


def safe_join(root: Path, rel: str) -> Path:
    """Resolve ``rel`` under ``root``; refuse absolute paths and anything that escapes ``root``."""
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or rel.strip() == "" or "\\" in rel or "\x00" in rel:
        raise ManifestError(f"manifest names an unsafe file path {rel!r}; refusing to use it")
    full = (root / Path(*pure.parts)).resolve()
    if not full.is_relative_to(root.resolve()):
        raise ManifestError(f"manifest path {rel!r} escapes the shard directory; refusing to use it")
    return full


def _files(raw: list[dict[str, Any]]) -> tuple[FileEntry, ...]:
    return tuple(FileEntry(path=str(f["path"]), sha256=str(f["sha256"]), size=int(f["size"])) for f in raw)


def _tensors(raw: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(name=str(t["name"]), dtype=str(t["dtype"]), shape=tuple(int(d) for d in t["shape"]))
        for t in raw
    )


def _graph(raw: dict[str, Any]) -> GraphEntry:
    return GraphEntry(name=str(raw["name"]), xml=str(raw["xml"]), rows=int(raw["rows"]),
                      mask=str(raw["mask"]), inputs=_tensors(raw["inputs"]), outputs=_tensors(raw["outputs"]))


def _moe(raw: dict[str, Any] | None) -> StageMoe | None:
    if raw is None:
        return None
    return StageMoe(experts=int(raw["experts"]), per_token=int(raw["per_token"]),
                    expert_bytes=int(raw["expert_bytes"]), dense_bytes=int(raw["dense_bytes"]))


def parse_manifest(data: dict[str, Any]) -> Manifest:
    """Build a :class:`Manifest` from decoded JSON, with a clear error for anything malformed."""
    try:
        version = int(data["format_version"])
        if version not in SUPPORTED_VERSIONS:
            raise ManifestError(
                f"shard format version {version} is not supported by this Deskfleet "
                f"(it reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}); "
                "re-export the model with this version"
            )
        m = data["model"]
        model = ModelInfo(
            name=str(m["name"]),
            fingerprint=str(m["fingerprint"]),
            architecture=str(m["architecture"]),
            num_layers=int(m["num_layers"]),
            hidden_size=int(m["hidden_size"]),
            vocab_size=int(m["vocab_size"]),
            num_attention_heads=int(m["num_attention_heads"]),
            num_kv_heads=int(m["num_kv_heads"]),
            head_dim=int(m["head_dim"]),
            max_position_embeddings=int(m["max_position_embeddings"]),
            bos_token_id=None if m.get("bos_token_id") is None else int(m["bos_token_id"]),
            eos_token_ids=tuple(int(t) for t in m["eos_token_ids"]),
        )
        w = data["weights"]
        weights = WeightInfo(
            format=str(w["format"]),
            group_size=None if w.get("group_size") is None else int(w["group_size"]),
            symmetric=bool(w.get("symmetric", True)),
        )
        stages = tuple(
            StageManifest(
                index=int(s["index"]),
                first_layer=int(s["first_layer"]),
                last_layer=int(s["last_layer"]),
                has_embedding=bool(s["has_embedding"]),
                has_head=bool(s["has_head"]),
                directory=str(s["directory"]),
                xml=str(s["xml"]),
                files=_files(s["files"]),
                inputs=_tensors(s["inputs"]),
                outputs=_tensors(s["outputs"]),
                beam_idx=bool(s["beam_idx"]),
                kv_cache_precision=str(s["kv_cache_precision"]),
                estimated_memory_bytes=int(s["estimated_memory_bytes"]),
                graphs=tuple(_graph(g) for g in s.get("graphs", ())),
                moe=_moe(s.get("moe")),
            )
            for s in data["stages"]
        )
        target = str(data.get("target", "stateful")) if version >= 2 else "stateful"
        raw_static = data.get("static") if version >= 2 else None
        static = None if raw_static is None else StaticInfo(
            context=int(raw_static["context"]),
            slots=int(raw_static.get("slots", 1)),
            prefill_chunk=None if raw_static.get("prefill_chunk") is None else int(raw_static["prefill_chunk"]),
        )
        manifest = Manifest(
            format_version=version,
            model=model,
            weights=weights,
            stages=stages,
            tokenizer_files=_files(data.get("tokenizer_files", [])),
            exporter=str(data.get("exporter", "")),
            created=str(data.get("created", "")),
            extra=dict(data.get("extra", {})),
            target=target,
            static=static,
        )
    except ManifestError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"manifest.json is malformed ({type(exc).__name__}: {exc}); re-export the model") from exc
    _check_consistency(manifest)
    return manifest


def _check_consistency(manifest: Manifest) -> None:
    stages = manifest.stages
    if not stages:
        raise ManifestError("manifest lists no stages; re-export the model")
    expected_first = 0
    for i, stage in enumerate(stages):
        if stage.index != i or stage.first_layer != expected_first or stage.last_layer < stage.first_layer:
            raise ManifestError(f"manifest stage {i} has an inconsistent layer range; re-export the model")
        expected_first = stage.last_layer + 1
    if expected_first != manifest.model.num_layers:
        raise ManifestError("manifest stages do not cover every layer of the model; re-export the model")
    if not stages[0].has_embedding or not stages[-1].has_head:
        raise ManifestError("manifest: the first stage must hold the embedding and the last the head")
    _check_target(manifest)
    for stage in stages:
        _check_graphs_listed(stage)


def ir_paths(xml: str) -> tuple[str, str]:
    """An OpenVINO IR's two files: the graph (``.xml``) and its weights (the same name, ``.bin``)."""
    return xml, str(PurePosixPath(xml).with_suffix(".bin"))


def _check_graphs_listed(stage: StageManifest) -> None:
    """Every graph a stage compiles, and its weights, must be among its hashed files: otherwise a
    runtime would compile a file nothing verified."""
    listed = {f.path for f in stage.files}
    for xml in dict.fromkeys((stage.xml, *(g.xml for g in stage.graphs))):
        for path in ir_paths(xml):
            if path not in listed:
                raise ManifestError(f"manifest stage {stage.index} compiles {xml}, but {path} is not among its "
                                    "hashed files, so it could not be verified; re-export the model")


def file_entry_for(stage: StageManifest, path: str) -> FileEntry:
    """The manifest entry of one of ``stage``'s files (listed: parsing checked that)."""
    return next(f for f in stage.files if f.path == path)


def _check_target(manifest: Manifest) -> None:
    """An NPU export must say what it fixed and list consistent static graphs on every stage."""
    if manifest.target not in TARGETS:
        raise ManifestError(f"manifest target {manifest.target!r} is unknown to this Deskfleet "
                            f"(it knows {', '.join(TARGETS)}); upgrade Deskfleet or re-export")
    static = manifest.static
    if manifest.target == "stateful":
        if static is not None or any(s.graphs for s in manifest.stages):
            raise ManifestError("manifest: a stateful export lists static graphs; re-export the model")
        return
    if static is None:
        raise ManifestError("manifest: an NPU export must record its static context; re-export the model")
    if not (static.slots >= 1 and static.context > static.slots
            and (static.prefill_chunk is None or 1 < static.prefill_chunk < static.context)):
        raise ManifestError(f"manifest: inconsistent static settings {static}; re-export the model")
    wanted = {"packed"} if static.slots > 1 else {"decode"} | ({"prefill"} if static.prefill_chunk else set())
    for stage in manifest.stages:
        names = [g.name for g in stage.graphs]
        if sorted(names) != sorted(wanted):
            raise ManifestError(f"manifest stage {stage.index} lists graphs {names}, expected "
                                f"{sorted(wanted)}; re-export the model")
        for g in stage.graphs:
            rows = {"decode": 1, "prefill": static.prefill_chunk, "packed": static.slots}[g.name]
            mask = "4d" if g.name == "packed" else "2d"
            if g.rows != rows or g.mask != mask:
                raise ManifestError(f"manifest stage {stage.index} graph {g.name!r} has {g.rows} rows "
                                    f"and a {g.mask} mask, expected {rows} and {mask}; re-export")


def load_manifest(export_dir: Path | str) -> Manifest:
    """Read and validate ``export_dir/manifest.json`` (file hashes are checked by :func:`verify_files`)."""
    root = Path(export_dir)
    if not root.is_dir():
        raise ManifestError(f"shard directory {root} does not exist; run `deskfleet export` first")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{root} has no {MANIFEST_NAME}: it is not a Deskfleet export "
                            "(or the export did not finish)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"cannot read {path}: {exc}; re-export the model") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{path} is not a JSON object; re-export the model")
    return parse_manifest(data)


def check_entry(entry: FileEntry, size: int, sha256: str) -> None:
    """ShardIntegrityError unless a file read as ``size`` bytes hashing to ``sha256`` is ``entry``."""
    if size != entry.size:
        raise ShardIntegrityError(
            f"shard file {entry.path} is {size} bytes but the manifest says {entry.size}: "
            "it is truncated or was modified; re-fetch or re-export the shard"
        )
    if sha256 != entry.sha256:
        raise ShardIntegrityError(
            f"shard file {entry.path} does not match its sha256 in the manifest: it was modified "
            "or corrupted; re-fetch or re-export the shard"
        )


def verify_files(root: Path | str, files: tuple[FileEntry, ...]) -> None:
    """Check every file's size and sha256; raise :class:`ShardIntegrityError` naming the first mismatch."""
    root = Path(root)
    for entry in files:
        path = safe_join(root, entry.path)
        if not path.is_file():
            raise ShardIntegrityError(f"shard file {entry.path} is missing from {root}; "
                                      "re-fetch or re-export the shard")
        size = path.stat().st_size
        check_entry(entry, size, sha256_file(path) if size == entry.size else "")


def verify_stage(root: Path | str, manifest: Manifest, index: int, target: str = "stateful", *,
                 skip: frozenset[str] = frozenset()) -> StageManifest:
    """Verify the files of one stage and return its manifest entry.

    ``target`` is what the caller's runtime runs: a stateful runtime handed an NPU export (or
    the reverse) is refused here, before anything is compiled and fed the wrong inputs.
    ``skip``: paths the caller verifies itself, on the very bytes it compiles (engine.shards.stage).
    """
    if manifest.target != target:
        how = {"npu": "the static runtime (engine.static.packed_stage)",
               "stateful": "a stateful runtime (deskfleet generate, serve, worker)"}
        raise ManifestError(
            f"{root} holds {manifest.target} shards, but this runs {target} shards: serve it with "
            f"{how.get(manifest.target, 'another runtime')}, or re-export with --target {target}")
    if not 0 <= index < len(manifest.stages):
        raise ManifestError(f"stage {index} does not exist; this export has {len(manifest.stages)} stages")
    stage = manifest.stages[index]
    verify_files(root, tuple(f for f in stage.files if f.path not in skip))
    return stage


def serving_runtime(manifest: Manifest) -> str:
    """``paged`` or ``static``: the runtime that serves ``manifest``'s export (its target decides)."""
    return SERVING_RUNTIMES[manifest.target]
