"""Paged stages: one PagedAttention infer per step for every stream's new tokens.

A :class:`PagedStage` is one verified stage of a CPU (or GPU) export, converted at load by
OpenVINO's ``paged_attention_transformation`` (a converted IR cannot be read back, so the
stateful IR is what ships). Its KV lives in a block pool (``key_cache.L``/``value_cache.L``,
``[pool_blocks, ...]`` as the compiled model asks) that the stage allocates once and never grows;
the coordinator owns the block tables and sends them with every step (:class:`StepPlan`), so the
stage holds no policy: :func:`paged_inputs` turns a plan into the PagedAttention inputs.
GPU: implemented (block size 16, cache layout read from the compiled inputs), untested: no
Intel GPU was available.

:class:`LocalPagedPath` runs the stages of one export back to back in this process. The plan itself is described in
:mod:`engine.wire.step_plan` and docs/PROTOCOL.md ("Step").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import GenerationError, ShardCompileError
from engine.paged.step import PagedOutcome, PagedStep
from engine.shards import tensor_names as tn
from engine.shards.manifest import Manifest, load_manifest
from engine.shards.stage import open_stage_model
from engine.shards.step_answer import answer_step, check_masks
from engine.wire.step_plan import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE, StepPlan, blocks_needed

SAMPLED = "sampled_tokens_indices"
# The block size each device's PagedAttention kernel is built for (openvino.genai's cache manager).
DEVICE_BLOCK_SIZE: Mapping[str, int] = {"CPU": CPU_BLOCK_SIZE, "GPU": GPU_BLOCK_SIZE}
# Cache element types a pool can hold as numpy arrays. numpy has no bf16: a bf16 cache (what a CPU
# with avx512_bf16 compiles for an f16 request, its inference precision being bf16) is held as raw
# 16-bit words, which the pool only copies, never reads as numbers. u4 caches are packed: refused.
CACHE_DTYPES: Mapping[str, np.dtype] = {
    "f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(np.uint16),
    "u8": np.dtype(np.uint8), "i8": np.dtype(np.int8),
}
# Ops that may sit between the LM head's MatMul and the logits output (a cast, a soft cap, a reshape).
_HEAD_PASS_THROUGH = frozenset({"Convert", "Multiply", "Divide", "Tanh", "Reshape", "Squeeze", "Unsqueeze"})
MAX_CONTEXT_LEN = "max_context_len"  # the paged conversion's own input (engine.shards.tensor_names lacks it)
_METADATA_INPUTS = (tn.POSITION_IDS, tn.PAST_LENS, tn.SUBSEQUENCE_BEGINS, tn.BLOCK_INDICES, tn.BLOCK_INDICES_BEGINS,
                    MAX_CONTEXT_LEN)


class PagedStageError(GenerationError):
    """Base of the paged stage's errors."""


class PoolBudgetError(PagedStageError):
    """A block pool larger than the stage's memory budget was asked for (the message says both)."""


class PoolNotAllocatedError(PagedStageError):
    """A step reached a stage whose block pool is not allocated, or is smaller than the plan's."""


class LMHeadNotFoundError(ShardCompileError):
    """The last stage's graph has no MatMul feeding its logits, so answered rows cannot be selected."""


def paged_inputs(plan: StepPlan, *, sampled: bool = False) -> dict[str, np.ndarray]:
    """The PagedAttention metadata of one step (every stage gets the same).

    Rows are the plan's streams in order, then (when ``plan.padded_tokens`` > T) one padding
    subsequence of ``pad`` rows: past 0, positions 0..pad-1, on scratch blocks 0..ceil(pad/bs)-1,
    never sampled. ``sampled``: add ``sampled_tokens_indices`` i64 [max(R, 1)], the answered rows
    in plan order (R = 0: the last real row, whose answer the caller drops).
    Shapes: position_ids i64 [Tb]; past_lens i32 [S']; subsequence_begins and block_indices_begins
    i32 [S'+1]; block_indices i32 [sum of blocks]; max_context_len i32 [] (S' = S + 1 with padding).
    """
    pad = plan.padded_tokens - plan.tokens
    past = [row.past_len for row in plan.rows]
    counts = [row.new_tokens for row in plan.rows]
    tables = [row.blocks for row in plan.rows]
    if pad:
        past.append(0)
        counts.append(pad)
        tables.append(tuple(range(blocks_needed(pad, plan.block_size))))
    positions = np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in zip(past, counts, strict=True)])
    out = {
        tn.POSITION_IDS: positions,
        tn.PAST_LENS: np.asarray(past, dtype=np.int32),
        tn.SUBSEQUENCE_BEGINS: np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
        tn.BLOCK_INDICES: np.asarray([b for table in tables for b in table], dtype=np.int32),
        tn.BLOCK_INDICES_BEGINS: np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
        MAX_CONTEXT_LEN: np.array(max(p + n for p, n in zip(past, counts, strict=True)), dtype=np.int32),
    }
    if sampled:
        rows = plan.sampled_indices() or [plan.tokens - 1]
        out[SAMPLED] = np.asarray(rows, dtype=np.int64)
    return out


def top1_reply(logits: np.ndarray, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The last stage's answer from logits [R, V] of the answered rows (plan order), without its
    top-k section: top-1 ids int64 [R], probabilities float32 [R] and the logits float32 [L, V] of
    the rows of ``want_logits`` streams (None when no stream wants them), masked rows' pick and
    logits taken over their allowed tokens. :func:`engine.shards.step_answer.answer_step` is the
    whole answer (top-k included)."""
    answer = answer_step(logits, plan)
    return answer.ids, answer.probs, answer.logits


def pool_tensor(element_type: ov.Type, shape: Sequence[int], *, commit: bool = True) -> tuple[np.ndarray, ov.Tensor]:
    """A zeroed pool ``shape`` = [pool_blocks, ...] for a cache the plugin compiled as
    ``element_type``: the numpy array the pool moves blocks in (:data:`CACHE_DTYPES`: a bf16 cache
    as raw uint16 words) and the tensor the infer request is bound to, which views the same memory
    under the cache's own type. ``commit``: every page written now (see PagedStage.allocate)."""
    dtype = CACHE_DTYPES.get(element_type.get_type_name())
    if dtype is None:
        raise PagedStageError(f"a paged pool cannot hold a {element_type.get_type_name()} KV cache; "
                              "use KV_CACHE_PRECISION f16, f32, bf16 or u8")
    if commit:
        arr = np.empty(tuple(shape), dtype=dtype)
        arr.fill(0)
    else:
        arr = np.zeros(tuple(shape), dtype=dtype)
    return arr, ov.Tensor(arr, ov.Shape(list(shape)), element_type)


def _name_first_input(model: ov.Model, name: str) -> None:
    """The conversion finds the token input by tensor name and flattens it by friendly name:
    set both (older torch exports call it ``x`` or ``hidden_states``)."""
    first = model.get_parameters()[0]
    first.set_friendly_name(name)
    first.output(0).get_tensor().set_names({name})


def _logits_head(model: ov.Model) -> ov.Node:
    """The MatMul whose output becomes the logits (through casts, soft caps or reshapes only)."""
    results = [r for r in model.get_results() if tn.LOGITS in r.input_value(0).get_names()] or model.get_results()
    node = results[0].input_value(0).get_node()
    for _ in range(8):
        if node.get_type_name() == "MatMul":
            return node
        if node.get_type_name() not in _HEAD_PASS_THROUGH:
            break
        inputs = [v.get_node() for v in node.input_values() if v.get_node().get_type_name() != "Constant"]
        if len(inputs) != 1:
            break
        node = inputs[0]
    raise LMHeadNotFoundError(f"the last stage of model {model.get_friendly_name()!r} has no MatMul feeding its "
                              "logits output; re-export the model with a current exporter")


def _sliding_windows(model: ov.Model) -> list[int] | None:
    """The stage's per-attention sliding windows (graph order, 0 = none) from its rt_info, if any."""
    if not model.has_rt_info(tn.SLIDING_WINDOW_RT_INFO):
        return None
    text = model.get_rt_info(tn.SLIDING_WINDOW_RT_INFO).astype(str)
    try:
        return [int(w) for w in text.split(",")]
    except ValueError as exc:
        raise ShardCompileError(f"the stage's {tn.SLIDING_WINDOW_RT_INFO} rt_info {text!r} is not a list of "
                                "windows; re-export the model") from exc


def _apply_sliding_windows(model: ov.Model, windows: list[int]) -> None:
    """Give each PagedAttention (``key_cache.N``: the N-th attention of the stage) its window."""
    attention = [op for op in model.get_ordered_ops() if op.get_type_name() == "PagedAttentionExtension"]
    by_cache = sorted(attention, key=lambda op: int(op.input_value(_PA_KEY_CACHE).get_any_name().split(".")[-1]))
    if len(by_cache) != len(windows):
        raise ShardCompileError(f"the stage names {len(windows)} attention windows but its paged conversion has "
                                f"{len(by_cache)} attentions; re-export the model")
    for op, window in zip(by_cache, windows, strict=True):
        if window:
            op.input(_PA_SLIDING_WINDOW).replace_source_output(ops.constant(np.int32(window)).output(0))


# PagedAttentionExtension's inputs: query, key, value, key_cache (3), value_cache, past_lens,
# subsequence_begins, block_indices, block_indices_begins, scale, sliding_window (10), ...
_PA_KEY_CACHE = 3
_PA_SLIDING_WINDOW = 10


def convert_to_paged(model: ov.Model, *, has_embedding: bool, has_head: bool) -> ov.Model:
    """``model`` (a stateful stage) converted in place to PagedAttention; on the last stage a
    Gather over a new ``sampled_tokens_indices`` input picks the rows that reach the LM head.
    A stage that lists sliding windows (:data:`~engine.shards.tensor_names.SLIDING_WINDOW_RT_INFO`)
    gets them on its PagedAttentions (each attends to the window's last positions, its own included)."""
    from openvino._offline_transformations import paged_attention_transformation

    _name_first_input(model, tn.first_input(has_embedding))
    windows = _sliding_windows(model)
    paged_attention_transformation(model, False, False, False)
    if windows is not None:
        _apply_sliding_windows(model, windows)
    if has_head:
        head = _logits_head(model)
        indices = ops.parameter([-1], ov.Type.i64, name=SAMPLED)
        indices.output(0).get_tensor().set_names({SAMPLED})
        picked = ops.gather(head.input_value(0), indices, ops.constant(np.int64(0)))  # [K, 1, H]
        head.input(0).replace_source_output(picked.output(0))
        model.add_parameters([indices])
        model.validate_nodes_and_infer_types()
    return model


class PagedStage:
    """One verified stage converted to PagedAttention, with its block pool."""

    def __init__(self, export_dir: Path | str, index: int, *, device: str = "CPU",
                 properties: Mapping[str, str] | None = None, exact: bool = False,
                 num_threads: int | None = None, manifest: Manifest | None = None,
                 verify: bool = True, core: ov.Core | None = None, cache_dir: Path | str | None = None):
        root = Path(export_dir)
        self.manifest = manifest or load_manifest(root)
        if self.manifest.target == "npu":
            raise PagedStageError(f"{root} is a static (NPU-target) export; paged stages serve CPU and GPU exports")
        if not 0 <= index < len(self.manifest.stages):
            raise GenerationError(f"{root} has stages 0..{len(self.manifest.stages) - 1}, not {index}")
        self.device = device
        self.block_size = DEVICE_BLOCK_SIZE.get(device.split(".")[0], CPU_BLOCK_SIZE)
        core = core or ov.Core()
        self.spec, self.properties, model, self._weights = open_stage_model(
            root, self.manifest, index, verify=verify, exact=exact, num_threads=num_threads, properties=properties,
            cache_dir=cache_dir, core=core)
        try:
            convert_to_paged(model, has_embedding=self.spec.has_embedding, has_head=self.spec.has_head)
            self.compiled = core.compile_model(model, device, self.properties)
        except RuntimeError as exc:
            raise ShardCompileError(f"OpenVINO could not convert stage {index} of {root} to PagedAttention or "
                                    f"compile it on {device}: {exc}") from exc
        self._first = self.compiled.inputs[0].get_any_name()
        names = {i.get_any_name() for i in self.compiled.inputs}
        self._logits_last = tn.LOGITS_LAST in names
        self._cache_inputs = [i for i in self.compiled.inputs if i.get_any_name().startswith((tn.KEY_CACHE_PREFIX,
                                                                                                tn.VALUE_CACHE_PREFIX))]
        self.request = self.compiled.create_infer_request()
        self.caches: list[np.ndarray] = []
        self.pool_blocks = 0

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def is_last(self) -> bool:
        return self.spec.has_head

    def _cache_dtype(self, element_type: ov.Type) -> np.dtype:
        dtype = CACHE_DTYPES.get(element_type.get_type_name())
        if dtype is None:
            raise PagedStageError(f"stage {self.index} compiled a {element_type.get_type_name()} KV cache, which a "
                                  f"paged pool cannot hold; use KV_CACHE_PRECISION f16, f32, bf16 or u8")
        return dtype

    def _block_dims(self, cache: ov.ConstOutput) -> list[int]:
        """Dims 1-3 of a cache input (heads, rows, columns, in the plugin's layout); dim 0 is the pool."""
        shape = cache.get_partial_shape()
        if shape.rank.is_dynamic or len(shape) != 4 or any(d.is_dynamic for d in shape[1:]):
            raise PagedStageError(f"stage {self.index} compiled {cache.get_any_name()} as {shape}; a paged pool "
                                  f"needs static dims 1-3 (this device's PagedAttention is not supported)")
        return [d.get_length() for d in shape[1:]]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every cache tensor of this stage (K and V of each layer)."""
        total = 0
        for cache in self._cache_inputs:
            total += int(np.prod(self._block_dims(cache))) * self._cache_dtype(cache.get_element_type()).itemsize
        return total

    def allocate(self, pool_blocks: int, budget_bytes: int, *, commit: bool = True) -> None:
        """Allocate (or reallocate, emptied) the pool of ``pool_blocks`` blocks on every cache
        tensor and bind it to the infer request; PoolBudgetError when it exceeds ``budget_bytes``.
        ``commit``: every page is written here (``np.zeros`` would map it lazily), so the pool is
        committed once, at load, and the stage's memory does not creep up as new blocks are first
        used. ``commit=False`` only maps the zeroed pages (each commits on its first write): for a
        worker whose first step must not wait for the pool's page writes, which it commits later
        (engine.paged.worker.commit_pages)."""
        need = pool_blocks * self.block_bytes
        if need > budget_bytes:
            raise PoolBudgetError(f"stage {self.index}: a pool of {pool_blocks} blocks needs {need} bytes "
                                  f"({self.block_bytes} per block), over its KV budget of {budget_bytes} bytes; "
                                  f"plan at most {budget_bytes // max(self.block_bytes, 1)} blocks or raise "
                                  "kv_pool_bytes")
        self.caches = []
        for cache in self._cache_inputs:
            arr, tensor = pool_tensor(cache.get_element_type(), (pool_blocks, *self._block_dims(cache)), commit=commit)
            self.request.set_tensor(cache.get_any_name(), tensor)
            self.caches.append(arr)
        self.pool_blocks = pool_blocks

    def _check(self, plan: StepPlan) -> None:
        if not self.caches:
            raise PoolNotAllocatedError(f"stage {self.index} has no block pool yet; allocate one before the first step")
        if plan.pool_blocks > self.pool_blocks:
            raise PoolNotAllocatedError(f"the plan assumes a pool of {plan.pool_blocks} blocks; stage {self.index} "
                                        f"holds {self.pool_blocks}")
        if plan.block_size != self.block_size:
            raise PagedStageError(f"the plan's block size {plan.block_size} is not stage {self.index}'s "
                                  f"{self.block_size} ({self.device})")

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` onto ``dst`` in every cache tensor, in order (copy-on-write)."""
        for src, dst in copies:
            for arr in self.caches:
                arr[dst] = arr[src]

    def export_blocks(self, blocks: Sequence[int]) -> list[np.ndarray]:
        """Copies of ``blocks`` from every cache tensor [len(blocks), ...] (moving a stream)."""
        return [arr[list(blocks)].copy() for arr in self.caches]

    def import_blocks(self, blocks: Sequence[int], data: Sequence[np.ndarray]) -> None:
        """Write :meth:`export_blocks`'s output into ``blocks`` of this pool (same layout only)."""
        if len(data) != len(self.caches) or any(d.shape != (len(blocks), *a.shape[1:]) or d.dtype != a.dtype
                                                for d, a in zip(data, self.caches, strict=False)):
            raise PagedStageError(f"the blocks do not match stage {self.index}'s cache layout")
        for arr, d in zip(self.caches, data, strict=True):
            arr[list(blocks)] = d

    def run(self, plan: StepPlan, x: np.ndarray) -> np.ndarray:
        """One infer for every row of ``plan``: ``x`` is token ids int64 [Tb] (stage 0) or hidden
        states [Tb, H]. Returns hidden states float32 [Tb, H], or on the last stage the logits
        float32 [R, V] of the answered rows in plan order (a private copy either way). The last
        stage refuses (TokenMaskError) a plan whose token masks do not fit its vocabulary V."""
        self._check(plan)
        ids = self.spec.has_embedding
        if x.ndim != (1 if ids else 2) or x.shape[0] != plan.padded_tokens or (
                ids != np.issubdtype(x.dtype, np.integer)):
            want = "token ids [Tb]" if ids else "hidden states [Tb, H]"
            raise PagedStageError(f"stage {self.index} takes {want} with Tb = {plan.padded_tokens}, got "
                                  f"{x.dtype}{list(x.shape)}")
        self.copy_blocks(plan.copies)
        inputs = paged_inputs(plan, sampled=self.is_last)
        if self.spec.has_embedding:
            inputs[self._first] = np.ascontiguousarray(x, dtype=np.int64)
        else:
            inputs[self._first] = np.ascontiguousarray(x, dtype=np.float32)
        if self._logits_last:
            inputs[tn.LOGITS_LAST] = np.array(1, dtype=np.int64)
        self.request.infer(inputs, share_inputs=True, share_outputs=True)
        out = self.request.get_output_tensor(0).data  # [Tb, 1, H] or [max(R, 1), 1, V]
        if self.is_last:
            logits = np.array(out.reshape(out.shape[0], -1)[:plan.sampled], dtype=np.float32)
            check_masks(plan, logits.shape[1])  # the width of the masks is the one thing only this stage knows
            return logits
        return np.array(out.reshape(out.shape[0], -1), dtype=np.float32)


class LocalPagedPath:
    """Every paged stage in this process; steps run one at a time on a worker thread (OpenVINO
    releases the GIL in ``infer``). Implements :class:`engine.paged.step.PagedPath`."""

    def __init__(self, stages: Sequence[PagedStage], pool_blocks: int, budget_bytes: int):
        if not stages:
            raise GenerationError("a paged path needs at least one stage")
        for i, stage in enumerate(stages):
            if stage.index != i:
                raise GenerationError(f"stage {stage.index} is in position {i}; stages must be given in order")
        if not stages[-1].is_last:
            raise GenerationError("the last stage does not hold the LM head; load every stage")
        if len({s.manifest.model.fingerprint for s in stages}) != 1:
            raise GenerationError("stages come from different models (fingerprints differ); re-export together")
        self.stages = list(stages)
        self.manifest = stages[0].manifest
        self.num_stages = len(stages)
        self.block_size = stages[0].block_size
        for stage in self.stages:
            stage.allocate(pool_blocks, budget_bytes)
        self.pool_blocks = pool_blocks
        self.results: asyncio.Queue[PagedOutcome] = asyncio.Queue()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deskfleet-paged-path")
        self._compute_s = [0.0] * self.num_stages
        self._steps = 0

    @classmethod
    def load(cls, export_dir: Path | str, pool_blocks: int, budget_bytes: int, **kwargs) -> LocalPagedPath:
        """Verify, convert and compile every stage of an export (``kwargs`` as :class:`PagedStage`)."""
        manifest = kwargs.pop("manifest", None) or load_manifest(export_dir)
        core = kwargs.pop("core", None) or ov.Core()
        stages = [PagedStage(export_dir, i, manifest=manifest, core=core, **kwargs)
                  for i in range(len(manifest.stages))]
        return cls(stages, pool_blocks, budget_bytes)

    async def async_start(self) -> None:
        return None

    def run(self, step: PagedStep) -> PagedOutcome:
        """One step through every stage, on the calling thread."""
        plan = step.plan
        ids = np.asarray(step.token_ids, dtype=np.int64)
        if ids.shape != (plan.tokens,):
            raise GenerationError(f"step {step.seq} carries {ids.shape} token ids for {plan.tokens} rows")
        x = np.zeros(plan.padded_tokens, dtype=np.int64)
        x[:plan.tokens] = ids
        stage_ms = []
        for i, stage in enumerate(self.stages):
            started = time.perf_counter()
            x = stage.run(plan, x)
            spent = time.perf_counter() - started
            self._compute_s[i] += spent
            stage_ms.append(1000 * spent)
        self._steps += 1
        answer = answer_step(x, plan)
        return PagedOutcome(step.seq, answer.ids, answer.probs, answer.logits, tuple(stage_ms),
                            top_ids=answer.top_ids, top_logprobs=answer.top_logprobs)

    async def async_submit(self, step: PagedStep) -> None:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self.run, step)

        def deliver(f: asyncio.Future) -> None:
            exc = f.exception()
            self.results.put_nowait(f.result() if exc is None else
                                    PagedOutcome.failed(step.seq, f"{type(exc).__name__}: {exc}"))

        future.add_done_callback(deliver)

    async def async_close(self) -> None:
        self._executor.shutdown(wait=True)

    def stage_metrics(self) -> dict[str, float]:
        steps = max(self._steps, 1)
        return {f"stage_compute_ms_per_step{{stage=\"{i}\"}}": 1000 * s / steps for i, s in enumerate(self._compute_s)}
