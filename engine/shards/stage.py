"""Run exported stages with OpenVINO: compile a verified shard, keep one KV state per stream.

A :class:`Stage` is one compiled shard; a :class:`StageStream` is one stream's KV state on it
(an InferRequest: OpenVINO keeps the ReadValue/Assign variables per request). A
:class:`LocalChain` runs stages back to back in one process: the in-process baseline that
the network runtime distributes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from engine.errors import GenerationError, ShardCompileError, ShardIntegrityError
from engine.shards.manifest import (
    Manifest,
    StageManifest,
    check_entry,
    file_entry_for,
    ir_paths,
    load_manifest,
    safe_join,
    verify_stage,
)
from engine.shards.tensor_names import ATTENTION_MASK, BEAM_IDX, LOGITS_LAST, POSITION_IDS

# Settings under which a split model is bit-exact with the unsplit one (identity tests).
EXACT_PROPERTIES: Mapping[str, str] = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
}
BEAM_IDX_ZERO = np.zeros(1, dtype=np.int32)


@dataclass(frozen=True)
class StepInputs:
    """One forward step as the coordinator decided it.

    x: token ids [1, S] int64 (stage 0) or hidden states [1, S, H] float32.
    attention_mask: [1, P + S] int64 over every physical cache position plus the new ones.
    position_ids: [1, S] int64 logical positions of the new tokens.
    """

    x: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    logits_last: int = 0  # the last stage computes logits for this many trailing positions (0 = all)


def stage_properties(stage: StageManifest, exact: bool = False, num_threads: int | None = None,
                     extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Plugin properties for compiling ``stage``: the shard's KV precision, or the exact set."""
    props = dict(EXACT_PROPERTIES) if exact else {"KV_CACHE_PRECISION": stage.kv_cache_precision}
    if num_threads:
        props["INFERENCE_NUM_THREADS"] = str(num_threads)
    props.update(extra or {})
    if props.get("KV_CACHE_PRECISION") == "f32":
        # An f32 cache means f32 attention: on a CPU with avx512_bf16 the default inference
        # precision is bf16, and its PagedAttention executor refuses any cache but bf16.
        props.setdefault("INFERENCE_PRECISION_HINT", "f32")
    return props


def _core() -> ov.Core:
    return ov.Core()


_HASH_STEP = 16 << 20


def _map(path: Path) -> tuple[mmap.mmap | None, int]:
    """``path`` mapped copy-on-write (never written back: OpenVINO's Tensor wants writable memory,
    and nothing writes it), and its size. The mapping keeps the file it was opened on: a file
    renamed over ``path`` later changes nothing here. (Rewriting the same file in place still
    would: only a private copy stops that, and a stage is too big to copy.)"""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        size = os.fstat(fd).st_size
        return (mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None), size
    finally:
        os.close(fd)  # the mapping holds its own reference to the file


def _sha256(view: memoryview) -> str:
    digest = hashlib.sha256()
    for start in range(0, len(view), _HASH_STEP):
        digest.update(view[start:start + _HASH_STEP])
    return digest.hexdigest()


def read_verified_model(core: ov.Core, root: Path, stage: StageManifest, xml: str, *,
                        verify: bool = True) -> tuple[ov.Model, mmap.mmap | None]:
    """Read the IR ``xml`` of ``stage`` from the very bytes that were hashed: the graph read once
    into memory, the weights hashed through a memory map that then backs the model's constants
    (no second open by path between check and compile). Returns the model and the mapping, which
    must outlive every model compiled from it. ShardIntegrityError if a hash does not match."""
    xml_rel, bin_rel = ir_paths(xml)
    xml_path, bin_path = safe_join(root, xml_rel), safe_join(root, bin_rel)
    try:
        graph = xml_path.read_bytes()
        weights, size = _map(bin_path)
    except FileNotFoundError as exc:
        raise ShardIntegrityError(f"shard file {exc.filename} is missing; re-fetch or re-export the shard") from exc
    view = memoryview(weights) if weights is not None else memoryview(b"")
    if verify:
        check_entry(file_entry_for(stage, xml_rel), len(graph), hashlib.sha256(graph).hexdigest())
        check_entry(file_entry_for(stage, bin_rel), size, _sha256(view))
    tensor = ov.Tensor(np.frombuffer(view, dtype=np.uint8), shared_memory=True) if size else ov.Tensor(
        np.zeros(0, dtype=np.uint8))
    return core.read_model(model=graph, weights=tensor), weights


def open_stage_model(root: Path, manifest: Manifest, index: int, *, verify: bool, exact: bool,
                     num_threads: int | None, properties: Mapping[str, str] | None,
                     cache_dir: Path | str | None, core: ov.Core
                     ) -> tuple[StageManifest, dict[str, str], ov.Model, mmap.mmap | None]:
    """Stage ``index`` of ``manifest`` ready to compile: its spec (its files checked unless
    ``verify`` is off; the IR itself is checked on the bytes read), its compile properties (the
    shard's KV precision or the exact set, threads, and CACHE_DIR for compiled blobs, so a
    restarted worker is ready in a fraction of the time) and its model read from the very bytes
    hashed, with the weights mapping that must outlive every model compiled from it."""
    spec = manifest.stages[index] if 0 <= index < len(manifest.stages) else None
    if verify:
        skip = frozenset(ir_paths(spec.xml)) if spec is not None else frozenset()
        spec = verify_stage(root, manifest, index, skip=skip)
    else:
        spec = manifest.stages[index]
    props = stage_properties(spec, exact, num_threads, properties)
    if cache_dir is not None:
        props = {**props, "CACHE_DIR": str(cache_dir)}
    model, weights = read_verified_model(core, root, spec, spec.xml, verify=verify)
    return spec, props, model, weights


class Stage:
    """One compiled, verified shard."""

    def __init__(self, export_dir: Path | str, index: int, *, device: str = "CPU",
                 properties: Mapping[str, str] | None = None, exact: bool = False,
                 num_threads: int | None = None, manifest: Manifest | None = None,
                 verify: bool = True, core: ov.Core | None = None, cache_dir: Path | str | None = None):
        root = Path(export_dir)
        self.manifest = manifest or load_manifest(root)
        self.device = device
        core = core or _core()
        self.spec, self.properties, model, self._weights = open_stage_model(
            root, self.manifest, index, verify=verify, exact=exact, num_threads=num_threads, properties=properties,
            cache_dir=cache_dir, core=core)
        try:
            self.compiled = core.compile_model(model, device, self.properties)
        except RuntimeError as exc:
            raise ShardCompileError(
                f"OpenVINO could not compile stage {index} of {root} on {device}: {exc}. "
                "Check that the device is available (`deskfleet doctor`) and has enough free memory."
            ) from exc
        self._input_name = self.spec.inputs[0].name
        self._has_beam = BEAM_IDX in self.spec.input_names
        self._has_logits_last = LOGITS_LAST in self.spec.input_names

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def is_last(self) -> bool:
        return self.spec.has_head

    def new_stream(self) -> StageStream:
        return StageStream(self)

    def fused_attention_count(self) -> int:
        """Fused ScaledDotProductAttention nodes in the runtime graph: one per layer when fusion fired."""
        count = 0
        for op in self.compiled.get_runtime_model().get_ops():
            rt = op.get_rt_info()
            if "layerType" in rt and rt["layerType"].astype(str) == "ScaledDotProductAttention":
                count += 1
        return count

    def feed(self, step: StepInputs) -> dict[str, np.ndarray]:
        inputs = {
            self._input_name: step.x,
            ATTENTION_MASK: step.attention_mask,
            POSITION_IDS: step.position_ids,
        }
        if self._has_beam:
            inputs[BEAM_IDX] = BEAM_IDX_ZERO
        if self._has_logits_last:
            inputs[LOGITS_LAST] = np.array(step.logits_last, dtype=np.int64)
        return inputs


class StageStream:
    """One stream's KV state on one stage."""

    def __init__(self, stage: Stage):
        self.stage = stage
        self.request = stage.compiled.create_infer_request()
        self.request.reset_state()

    def forward(self, step: StepInputs) -> np.ndarray:
        """Run one step; returns hidden states [1, S, H] or logits [1, S, V] (a private copy)."""
        self.request.infer(self.stage.feed(step), share_inputs=True, share_outputs=True)
        return np.array(self.request.get_output_tensor(0).data, copy=True)

    def reset(self) -> None:
        self.request.reset_state()

    def snapshot(self, keep: np.ndarray) -> list[np.ndarray]:
        """Copies of every KV state [1, KV, n, D] compacted to the physical positions ``keep``."""
        out = []
        for state in self.request.query_state():
            data = state.state.data  # [1, KV, P, D]
            if keep.size and int(keep[-1]) >= data.shape[2]:
                raise GenerationError(f"capture asks for position {int(keep[-1])} of a {data.shape[2]}-position cache")
            out.append(np.ascontiguousarray(data[:, :, keep, :]))
        return out

    def load(self, snapshot: Sequence[np.ndarray], length: int) -> None:
        """Make this stream's cache the first ``length`` positions of ``snapshot``."""
        states = self.request.query_state()
        if len(states) != len(snapshot):
            raise GenerationError("the capture does not match this stage's KV layout")
        for state, data in zip(states, snapshot, strict=True):
            state.state = ov.Tensor(np.ascontiguousarray(data[:, :, :length, :]))


class LocalChain:
    """Stages of one export run back to back in this process."""

    def __init__(self, stages: Sequence[Stage]):
        if not stages:
            raise GenerationError("a chain needs at least one stage")
        for i, stage in enumerate(stages):
            if stage.index != i:
                raise GenerationError(f"stage {stage.index} is in position {i}; stages must be given in order")
        if not stages[-1].is_last:
            raise GenerationError("the last stage of the chain does not hold the LM head; load every stage")
        fingerprints = {s.manifest.model.fingerprint for s in stages}
        if len(fingerprints) != 1:
            raise GenerationError("stages come from different models (fingerprints differ); re-export together")
        self.stages = list(stages)
        self.manifest = stages[0].manifest

    @classmethod
    def load(cls, export_dir: Path | str, **kwargs) -> LocalChain:
        """Verify and compile every stage of an export."""
        manifest = load_manifest(export_dir)
        core = kwargs.pop("core", None) or _core()
        return cls([Stage(export_dir, i, manifest=manifest, core=core, **kwargs)
                    for i in range(len(manifest.stages))])

    def new_streams(self) -> list[StageStream]:
        return [s.new_stream() for s in self.stages]

    @staticmethod
    def forward(streams: Sequence[StageStream], step: StepInputs) -> np.ndarray:
        """Logits [1, S, V] for the new positions, passing hidden states stage to stage."""
        x = step.x
        for stream in streams:
            x = stream.forward(StepInputs(x, step.attention_mask, step.position_ids, step.logits_last))
        return x
