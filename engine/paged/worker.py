"""A stage worker for a paged stage: one PagedAttention infer per Step for every stream in it.

The coordinator owns the block tables; every **Step** frame carries the plan (which streams,
their past lengths, new tokens and blocks) and the rows' input, so the stage holds no stream
state at all, only its block pool. The pool is allocated on the first plan of a session, within
the worker's KV budget (``kv_pool_bytes``; a plan asking for more is refused with both numbers),
and never grows. A process's first pool (a new worker's, a promoted spare's: the step that opens
it is a failover's replay) is only mapped then: writing every page of a GiB took 0.6-3 s on the
2-core test box, so its pages are committed behind the first steps (:func:`commit_pages`, after
:data:`POOL_COMMIT_DELAY_S`) instead of in them; a later session of another size allocates as
:meth:`PagedStage.allocate` does, committed at once.

Each stage appends its compute time to the Step it passes on; the last one answers the
coordinator's return port with a **StepReply** (top-1 of the answered rows, logits for the
streams that asked).

One session at a time, as a packed (static) worker: it belongs to the upstream connection that
opened it, and a Step from another connection is refused while that one is open. A Step of a new
session starts it on a pool the coordinator considers empty; Release(session) ends the session
and frees nothing else. A step that fails answers Error(STREAM_FAILED, session, seq); the session
and the pool stay (the coordinator re-plans the step).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import sys
import threading
import time
from collections.abc import Sequence
from ssl import SSLContext

import numpy as np

from engine.errors import DeskfleetError
from engine.paged.stage import PagedStage
from engine.shards.step_answer import answer_step
from engine.trust.peer_policy import PeerPolicy
from engine.wire.address import Address
from engine.wire.format import ErrorCode, StreamId
from engine.wire.messages import Error, Message, Packed, Release, Step
from engine.wire.stage_server import SessionServer
from engine.wire.step_codec import step_frame_bound
from engine.wire.step_plan import GPU_BLOCK_SIZE, MAX_STEP_ROWS, MAX_STEP_TOKENS, StepPlan, blocks_needed
from engine.wire.transport import Connection

log = logging.getLogger(__name__)

DEFAULT_STEP_TOKENS = 4096  # padded rows of the largest Step a worker accepts unless told otherwise
POOL_COMMIT_DELAY_S = 3.0  # a first pool's pages are committed this long after it opens (after a replay)
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without touching their bytes
_COMMIT_SLICE = 16 << 20  # bytes committed per madvise call


def map_pool(stage: PagedStage, pool_blocks: int, budget_bytes: int) -> list[np.ndarray]:
    """Give ``stage`` a pool of ``pool_blocks`` zeroed blocks whose pages are mapped, not yet
    committed (each is by its first write, or by :func:`commit_pages`); PoolBudgetError over
    ``budget_bytes``. The pool's arrays."""
    stage.allocate(pool_blocks, budget_bytes, commit=False)
    return list(stage.caches)


def commit_pages(arrays: Sequence[np.ndarray]) -> bool:
    """Commit every whole page of ``arrays`` without changing a byte (safe while steps write into
    them), so the pool's memory is taken now rather than creeping up as blocks are first used.
    False where the kernel cannot (not Linux, or older than 5.14): pages then commit on first use."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    for arr in arrays:
        start = arr.ctypes.data
        lo, hi = -(-start // page) * page, (start + arr.nbytes) // page * page
        while lo < hi:  # in slices, so the steps' own page faults and mappings never wait long
            size = min(_COMMIT_SLICE, hi - lo)
            if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(size), _MADV_POPULATE_WRITE) != 0:
                log.debug("madvise(MADV_POPULATE_WRITE) failed (errno %d): the pool commits as it is used",
                          ctypes.get_errno())
                return False
            lo += size
            time.sleep(0.002)
    return True


def paged_frame_bound(hidden_size: int, context: int, max_step_tokens: int = DEFAULT_STEP_TOKENS,
                      vocab_size: int = 0) -> int:
    """The largest Step a paged stage's upstream may send it: ``max_step_tokens`` rows of float32
    hidden states, as many streams as a step holds, each with a block table over ``context``, and
    an allowed-token mask over ``vocab_size`` on every row (the plan, masks included, passes every stage)."""
    return step_frame_bound(hidden_size, min(max_step_tokens, MAX_STEP_TOKENS), MAX_STEP_ROWS,
                            MAX_STEP_ROWS * blocks_needed(context, GPU_BLOCK_SIZE), vocab_size=vocab_size)


class PagedStageWorker(SessionServer):
    """Serves one paged stage; ``next_address`` is the next stage, or the coordinator's return port."""

    def __init__(self, stage: PagedStage, listen: Address, next_address: Address, *, kv_pool_bytes: int,
                 server_ssl: SSLContext | None = None, client_ssl: SSLContext | None = None,
                 dial_deadline: float = 120.0, peers: PeerPolicy | None = None,
                 max_step_tokens: int = DEFAULT_STEP_TOKENS, **listener_options):
        self.stage = stage
        self.kv_pool_bytes = kv_pool_bytes
        self._committer: threading.Timer | None = None
        model = stage.manifest.model
        super().__init__(stage.index, stage.is_last, model.fingerprint, listen, next_address,
                         server_ssl=server_ssl, client_ssl=client_ssl, dial_deadline=dial_deadline,
                         thread_name=f"deskfleet-paged{stage.index}", peers=peers,
                         max_frame_bytes=paged_frame_bound(stage.manifest.activation_width,
                                                           model.max_position_embeddings, max_step_tokens,
                                                           model.vocab_size),
                         **listener_options)

    async def _handle(self, conn: Connection, msg: Message) -> None:
        # an upstream Error of a session is passed on toward the coordinator: only its owner may send one
        carried = isinstance(msg, Step | Release) or (isinstance(msg, Error) and msg.stream_id)
        if carried and not await self._carried_by(conn, msg, _session_of(msg)):
            return
        match msg:
            case Step():
                self._owner = conn
                await self._step(msg)
            case Release():
                if msg.stream_id == self.session:
                    self.session = None
                if not self.stage.is_last:
                    await self._send(msg)
            case Packed():
                await self._send(Error(ErrorCode.STREAM_FAILED, f"stage {self.index} serves a paged stage: it takes "
                                       f"Step frames, not {type(msg).__name__}", msg.stream_id, msg.seq))
            case Error() if msg.stream_id:
                await self._send(msg)  # a step failed upstream: on toward the coordinator
            case _:
                log.debug("paged stage %d ignoring %r", self.index, msg)

    async def _on_close(self, conn: Connection) -> None:
        """The session of a vanished upstream ends here and on the later stages."""
        if conn is not self._owner:
            return
        session, self.session, self._owner = self.session, None, None
        if session is not None and not self.stage.is_last:
            with contextlib.suppress(DeskfleetError):
                await self.downstream.async_send_if_connected(Release(session))

    def _open_pool(self, plan: StepPlan) -> None:
        """A new session's pool: the plan's size, allocated (empty) unless the stage holds it already;
        the process's first one mapped now and committed in the background a little later."""
        if self.stage.pool_blocks == plan.pool_blocks:
            return
        if self.stage.caches:
            self.stage.allocate(plan.pool_blocks, self.kv_pool_bytes)
            return
        arrays = map_pool(self.stage, plan.pool_blocks, self.kv_pool_bytes)
        self._committer = threading.Timer(POOL_COMMIT_DELAY_S, commit_pages, (arrays,))
        self._committer.daemon = True
        self._committer.start()

    def _timed_run(self, plan: StepPlan, x: np.ndarray) -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        out = self.stage.run(plan, x)
        return out, 1000 * (time.perf_counter() - started)

    async def _fail(self, msg: Step, exc: Exception) -> None:
        log.error("paged stage %d failed on step %d of session %s: %s", self.index, msg.seq, msg.session, exc)
        await self._send(Error(ErrorCode.STREAM_FAILED, f"stage {self.index}: {exc}", msg.session, msg.seq))

    async def _step(self, msg: Step) -> None:
        if msg.session != self.session:
            if self.draining:
                await self._send(Error(ErrorCode.SHUTTING_DOWN, f"stage {self.index} is shutting down",
                                       msg.session, msg.seq))
                return
            try:
                await self._run(self._open_pool, msg.plan)
            except Exception as exc:  # over budget, or no memory: no session starts
                await self._fail(msg, exc)
                return
            self.session = msg.session
        try:
            out, ms = await self._compute(self._timed_run, msg.plan, msg.tensor)
        except Exception as exc:  # a bad plan or an OpenVINO failure must not take the worker down
            await self._fail(msg, exc)
            return
        reply: Message
        if self.stage.is_last:
            reply = answer_step(out, msg.plan).reply(msg.session, msg.seq, (*msg.stage_ms, ms))
        else:
            reply = msg.passed_on(out, ms)
        await self._send(reply)

    async def async_close(self) -> None:
        if self._committer is not None:
            self._committer.cancel()
        await super().async_close()
        self.session = None
        self._owner = None


def _session_of(msg: Message) -> StreamId:
    return msg.session if isinstance(msg, Step) else StreamId(getattr(msg, "stream_id", 0))
