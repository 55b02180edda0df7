"""Run static (NPU-target) shards: one stage with its host KV ring, a chain, and the serving loop.

A :class:`StaticStage` compiles the graphs of one stage of an ``--target npu`` export and owns
that stage's :class:`~engine.static.kv_ring.KVRing`. Its only input besides the activations is the
stage-0 :class:`~engine.static.packing.PlanFrame`, from which it derives its mask and KV writes
(:func:`~engine.static.packing.layout_step`), so every stage's ring stays in lockstep. A
:class:`StaticChain` runs stages back to back in this process. :class:`PackedServer` is the
thin stage-0 loop: admit, plan, infer, sample greedily, retire; every decision is in
:mod:`engine.static.slot_scheduler`.

The same IR compiles for CPU and NPU; only the device string differs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

from engine.errors import GenerationError, ManifestError, ShardCompileError
from engine.shards.manifest import GraphEntry, Manifest, ir_paths, load_manifest, verify_stage
from engine.shards.stage import read_verified_model
from engine.shards.tensor_names import ATTENTION_BIAS, ATTENTION_MASK, POSITION_IDS
from engine.static.kv_ring import DEFAULT_SINKS, KVRing, SlotRing
from engine.static.packing import SlotGeometry, additive_bias, layout_step, shared_mask
from engine.static.slot_scheduler import (
    Slot,
    SlotRequest,
    TokenEvent,
    admit,
    admit_queued,
    empty_slots,
    plan,
    update,
)
from engine.wire.plan_frame import PlanFrame

# Bit-exact settings (see NOTES-openvino-cpu.md); the KV precision is the host ring's (f32).
EXACT_PROPERTIES: Mapping[str, str] = {
    "INFERENCE_PRECISION_HINT": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
}


def static_manifest(manifest: Manifest) -> Manifest:
    """``manifest`` if it is an NPU export, else a clear error."""
    if manifest.target != "npu" or manifest.static is None:
        raise ManifestError(f"{manifest.model.name} was exported for the {manifest.target} target; "
                            "static serving needs `deskfleet export --target npu --context T`")
    return manifest


def geometry_of(manifest: Manifest, sinks: int = DEFAULT_SINKS) -> SlotGeometry:
    static = static_manifest(manifest).static
    assert static is not None
    return SlotGeometry(window=static.window, slots=static.slots, sinks=sinks)


def export_row_options(manifest: Manifest) -> tuple[int, ...]:
    """The row counts of the graphs every stage of the export has (1 decode row, C prefill rows, or S)."""
    stages = static_manifest(manifest).stages
    return tuple(sorted(set.intersection(*({g.rows for g in st.graphs} for st in stages))))


class StaticStage:
    """One stage of a static export: its compiled graphs, its KV ring and its slots' bookkeeping."""

    def __init__(self, export_dir: Path | str, index: int, *, device: str = "CPU", exact: bool = False,
                 num_threads: int | None = None, properties: Mapping[str, str] | None = None,
                 manifest: Manifest | None = None, core: ov.Core | None = None,
                 sinks: int = DEFAULT_SINKS, graphs: Sequence[str] | None = None):
        root = Path(export_dir)
        self.manifest = static_manifest(manifest or load_manifest(root))
        spec = self.manifest.stages[index] if 0 <= index < len(self.manifest.stages) else None
        chosen = [g for g in spec.graphs if graphs is None or g.name in graphs] if spec is not None else []
        # the graphs compiled are verified below, on the very bytes compiled (engine.shards.stage)
        self.spec = verify_stage(root, self.manifest, index, target="npu",
                                 skip=frozenset(p for g in chosen for p in ir_paths(g.xml)))
        self._mapped: list = []  # the weights' memory maps: they back the compiled graphs' constants
        self.geometry = geometry_of(self.manifest, sinks)
        props = dict(EXACT_PROPERTIES) if exact else {}
        if num_threads:
            props["INFERENCE_NUM_THREADS"] = str(num_threads)
        props.update(properties or {})
        core = core or ov.Core()
        self.graphs: dict[int, tuple[GraphEntry, ov.InferRequest, list[str]]] = {}
        for entry in self.spec.graphs:
            if graphs is not None and entry.name not in graphs:
                continue
            model, mapped = read_verified_model(core, root, self.spec, entry.xml)
            self._mapped.append(mapped)
            try:
                compiled = core.compile_model(model, device, props)
            except RuntimeError as exc:
                raise ShardCompileError(f"OpenVINO could not compile the {entry.name} graph of stage {index} "
                                        f"of {root} on {device}: {exc}") from exc
            new_kv = [port.get_any_name() for port in compiled.outputs[1:]]  # new_key_i, new_value_i
            self.graphs[entry.rows] = (entry, compiled.create_infer_request(), new_kv)
        if not self.graphs:
            raise ManifestError(f"stage {index} has none of the graphs {list(graphs or [])}; it has "
                                + ", ".join(g.name for g in self.spec.graphs))
        m = self.manifest.model
        self.ring = KVRing(self.spec_layers, m.num_kv_heads, m.head_dim, self.geometry.window)
        self.slots: tuple[SlotRing, ...] = self.geometry.rings()
        self._first = self.spec.inputs[0].name

    @property
    def spec_layers(self) -> range:
        return range(self.spec.first_layer, self.spec.last_layer + 1)

    @property
    def row_options(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    @property
    def is_last(self) -> bool:
        return self.spec.has_head

    def reset(self) -> None:
        self.slots = self.geometry.rings()

    def step(self, frame: PlanFrame, x: np.ndarray) -> np.ndarray:
        """One inference: ``x`` [1, S] ids or [1, S, H] hidden -> [1, S, H] hidden or [1, S, V] logits."""
        if frame.rows not in self.graphs:
            raise GenerationError(f"stage {self.spec.index} has no {frame.rows}-row graph "
                                  f"(it has {', '.join(map(str, self.graphs))})")
        entry, request, new_kv = self.graphs[frame.rows]
        window = self.geometry.window
        layout = layout_step(self.slots, frame, window)
        inputs: dict[str, np.ndarray] = {self._first: x, POSITION_IDS: frame.position[None, :]}
        if entry.mask == "4d":
            inputs[ATTENTION_BIAS] = additive_bias(layout.mask)  # [1, 1, S, W + S]
        else:
            inputs[ATTENTION_MASK] = shared_mask(layout, frame, window)  # [1, W + S]
        inputs.update(self.ring.arrays)
        request.infer(inputs, share_inputs=True, share_outputs=True)
        new = {name: request.get_tensor(name).data for name in new_kv}  # [1, KV, S, D] each
        self.ring.write(new, layout.write_rows, layout.write_columns)
        self.slots = layout.rings
        return np.array(request.get_output_tensor(0).data, copy=True)


class StaticChain:
    """The stages of one static export run back to back; the frame travels with the activations."""

    def __init__(self, stages: Sequence[StaticStage]):
        if not stages or not stages[-1].is_last:
            raise GenerationError("a static chain needs every stage of the export, in order")
        for i, st in enumerate(stages):
            if st.spec.index != i:
                raise GenerationError(f"stage {st.spec.index} is in position {i}; give stages in order")
        if len({st.row_options for st in stages}) != 1 or len({st.geometry for st in stages}) != 1:
            raise GenerationError("every stage must be started with the same graphs and slot count")
        self.stages = list(stages)
        self.manifest = stages[0].manifest
        self.geometry = stages[0].geometry

    @classmethod
    def load(cls, export_dir: Path | str, **kwargs) -> StaticChain:
        manifest = static_manifest(load_manifest(export_dir))
        core = kwargs.pop("core", None) or ov.Core()
        return cls([StaticStage(export_dir, i, manifest=manifest, core=core, **kwargs)
                    for i in range(len(manifest.stages))])

    @property
    def row_options(self) -> tuple[int, ...]:
        return self.stages[0].row_options

    def reset(self) -> None:
        for st in self.stages:
            st.reset()

    def step(self, frame: PlanFrame, tokens: np.ndarray) -> np.ndarray:
        """Logits [1, S, V] for the frame's rows; ``tokens`` int64 [S]."""
        x = tokens[None, :]
        for st in self.stages:
            x = st.step(frame, x)
        return x


@dataclass
class Completion:
    """One finished (or running) request as the server saw it."""

    request_id: int
    tokens: list[int] = field(default_factory=list)
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft_s(self) -> float:
        return (self.first_token or self.submitted) - self.submitted


class PackedServer:
    """Greedy serving of many requests on a static chain (packed: one row per decoding slot).

    ``submit`` queues a request (refusing a prompt no slot can hold); ``step`` admits what fits,
    runs one inference and returns the tokens it produced; ``run`` steps until all are done.
    """

    def __init__(self, chain: StaticChain):
        self.chain = chain
        self.geometry = chain.geometry
        self.slots: tuple[Slot, ...] = empty_slots(self.geometry)
        self.queue: list[SlotRequest] = []
        self.completions: dict[int, Completion] = {}
        self._next_id = 1
        self.steps = 0

    def submit(self, prompt: Sequence[int], max_new_tokens: int, *, eos_ids: Sequence[int] = (),
               ignore_eos: bool = False) -> int:
        request = SlotRequest(self._next_id, tuple(int(t) for t in prompt), max_new_tokens,
                              frozenset(eos_ids), ignore_eos)
        admit(empty_slots(self.geometry), request, self.geometry)  # refuses what can never fit
        self._next_id += 1
        self.queue.append(request)
        self.completions[request.request_id] = Completion(request.request_id, submitted=time.perf_counter())
        return request.request_id

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(s.request for s in self.slots)

    def step(self) -> list[TokenEvent]:
        self.slots = admit_queued(self.slots, self.queue, self.geometry)
        schedule = plan(self.slots, self.chain.row_options)
        if schedule is None:
            return []
        logits = self.chain.step(schedule.frame, schedule.tokens)  # [1, S, V]
        sampled = {row: int(np.argmax(logits[0, row])) for row in schedule.sample.values()}
        self.slots, events = update(self.slots, schedule, sampled, self.geometry)
        self.steps += 1
        now = time.perf_counter()
        for e in events:
            c = self.completions[e.request_id]
            c.tokens.append(e.token)
            c.first_token = c.first_token or now
            if e.finished:
                c.finished = now
        return events

    def run(self) -> dict[int, Completion]:
        while self.busy:
            self.step()
        return self.completions


def static_generate(chain: StaticChain, prompt: Sequence[int], max_new_tokens: int,
                    **kwargs) -> list[int]:
    """One request alone on a fresh chain: greedy tokens (the unpacked baseline of the tests)."""
    chain.reset()
    server = PackedServer(chain)
    rid = server.submit(prompt, max_new_tokens, **kwargs)
    return server.run()[rid].tokens
