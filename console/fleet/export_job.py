"""An export running in a background process, with progress, cancellation and the exporter's
own error message.

The export needs a lot of memory for a while (and torch for an NPU target); a separate process
keeps both out of the fleet service and makes cancelling a plain ``terminate()``. The process
reports over a one-way pipe (frozen messages, no threads on either side). Whoever owns the job
calls :meth:`ExportJob.poll` (a Qt timer, or :meth:`ExportJob.wait` / :meth:`ExportJob.async_wait`),
which drains the pipe and hands every event to ``on_event`` on the caller's thread.

What the process does: resolve the model (a GGUF's config and tokenizer are written once), fingerprint it, turn
``stages``/``split`` into the cut points, and reuse an existing export with the same
:class:`~console.fleet_api.exports.ExportKey`; otherwise run ``export_model``, which writes
into a hidden ``.NAME.partial-PID`` sibling and renames it into place only when complete. A
terminated process never reaches that rename; :meth:`ExportJob.cancel` then removes the
partial directory it leaves, so a cancelled export leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from console.fleet.errors import ExportCancelledError, ExportJobError, ExportTimeoutError
from console.fleet.export_catalog import find_export, partial_dir
from console.fleet_api.exports import (
    ExportCancelled,
    ExportEvent,
    ExportFailed,
    ExportFinished,
    ExportInfo,
    ExportKey,
    ExportProgress,
    ExportSpec,
)

log = logging.getLogger(__name__)

# The exporter's steps per stage, in order (export.cli.EXPORT_STEPS; repeated here so that the
# console does not import the export package to draw a progress bar).
STAGE_STEPS = ("load", "convert", "stateful", "compress", "save")
PREPARE_STEPS = ("resolve", "fingerprint")  # before the first stage: stage None
CANCEL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ExportRequest:
    """What to export. ``model`` is a checkpoint directory or .gguf path, or None for the embedded
    default; exactly one of ``stages``/``split`` is set."""

    model: str | None
    exports_dir: Path
    spec: ExportSpec = ExportSpec()
    stages: int | None = None
    split: tuple[int, ...] | None = None


def export_fraction(stage: int | None, step: str, n_stages: int) -> float:
    """Fraction done when ``step`` of ``stage`` begins (an NPU export's "static" sits at "stateful")."""
    if stage is None:
        return 0.0
    index = STAGE_STEPS.index("stateful" if step == "static" else step)
    return (stage * len(STAGE_STEPS) + index) / (n_stages * len(STAGE_STEPS))


# -- the background process ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Writing:
    out_dir: Path  # the process is about to create this export


@dataclass(frozen=True)
class _Done:
    out_dir: Path
    reused: bool


def _export_process(request: ExportRequest, conn: Connection) -> None:
    """Entry point of the export process: every outcome, success or failure, is one message."""
    try:
        _export(request, conn.send)
    except Exception as exc:  # noqa: BLE001 - reported to the fleet service, not raised into nowhere
        from engine.errors import DeskfleetError

        message = str(exc) if isinstance(exc, DeskfleetError) else (
            f"unexpected {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")
        conn.send(ExportFailed(type(exc).__name__, message))
    finally:
        conn.close()


def _export(request: ExportRequest, send: Callable[[object], None]) -> None:
    from export.exporter import export_model, plan_stages, read_config
    from export.options import ExportOptions
    from export.sources import model_fingerprint, resolve_model

    send(ExportProgress(None, "resolve", 0.0))
    source = resolve_model(request.model)
    send(ExportProgress(None, "fingerprint", 0.0))
    fingerprint = model_fingerprint(source.weights)
    config = read_config(source.weights)
    plan = plan_stages(int(config["num_hidden_layers"]), request.stages, request.split)
    key = ExportKey.of_request(fingerprint, [s.first_layer for s in plan[1:]], request.spec)
    existing = find_export(request.exports_dir, key)
    if existing is not None:
        send(_Done(existing.path, reused=True))
        return
    out = request.exports_dir / key.export_id(source.name)
    send(_Writing(out))

    def progress(stage: int, step: str) -> None:
        send(ExportProgress(stage, step, export_fraction(stage, step, len(plan))))

    options = ExportOptions(**request.spec.options_kwargs())
    export_model(source.weights, out, split=list(key.split), options=options, name=source.name,
                 fingerprint=fingerprint, progress=progress)
    send(_Done(out, reused=False))


# -- the fleet service's handle ----------------------------------------------------------------------------


class ExportJob:
    """One export in a background process. ``state`` is pending, running, finished, failed or
    cancelled; ``on_event`` is called from whichever thread calls :meth:`poll`."""

    def __init__(self, request: ExportRequest, on_event: Callable[[ExportEvent], None] | None = None) -> None:
        self.request = request
        self._on_event = on_event or (lambda event: None)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._writing: Path | None = None
        self._started = 0.0
        self.state = "pending"
        self.fraction = 0.0
        self.result: ExportInfo | None = None
        self.reused = False
        self.failure: ExportFailed | None = None

    def start(self) -> ExportJob:
        if self._process is not None:
            raise ExportJobError("this export job was already started; start a new one to export again")
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
        receiver, sender = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_export_process, args=(self.request, sender),
                                    name="deskfleet-export", daemon=True)
        self._started = time.monotonic()
        self._process.start()
        sender.close()  # the child holds the only write end: EOF means it is gone
        self._conn = receiver
        self.state = "running"
        return self

    @property
    def done(self) -> bool:
        return self.state in ("finished", "failed", "cancelled")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def poll(self, timeout: float = 0.0) -> list[ExportEvent]:
        """Handle what the process reported (waiting up to ``timeout`` s for the first message)."""
        events = self._drain(timeout)
        if events and events[-1] is None:  # the process is gone without a word
            events[-1] = self._process_died()
        for event in events:
            self._on_event(event)
        return events

    def _drain(self, timeout: float) -> list:
        """Messages in the pipe, as events; a trailing None marks EOF before any result."""
        events: list = []
        wait = timeout
        while self._conn is not None and not self.done and self._conn.poll(wait):
            wait = 0.0
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                events.append(None)
                break
            event = self._handle(message)
            if event is not None:
                events.append(event)
        return events

    def _handle(self, message: object) -> ExportEvent | None:
        if isinstance(message, _Writing):
            self._writing = message.out_dir
            return None
        if isinstance(message, ExportProgress):
            self.fraction = max(self.fraction, message.fraction)
            return message
        if isinstance(message, _Done):
            self.result, self.reused = ExportInfo.read(message.out_dir), message.reused
            self.state, self.fraction = "finished", 1.0
            self._reap()
            return ExportFinished(self.result, message.reused, time.monotonic() - self._started)
        if isinstance(message, ExportFailed):
            self.failure, self.state = message, "failed"
            self._reap()
            return message
        raise AssertionError(f"unknown message from the export process: {message!r}")

    def _process_died(self) -> ExportFailed:
        self._reap()
        code = self._process.exitcode if self._process is not None else None
        self.failure = ExportFailed("ProcessDied", f"the export process exited (code {code}) without a result: "
                                    "it could not start (its error is on the fleet service's stderr), was killed, "
                                    "or ran out of memory. For the last, close other programs or choose "
                                    "smaller weights (int4), then export again.")
        self.state = "failed"
        self._remove_partial()
        return self.failure

    def _reap(self, timeout: float = CANCEL_TIMEOUT_S) -> None:
        if self._process is not None:
            self._process.join(timeout)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _remove_partial(self) -> None:
        if self._writing is not None and self._process is not None and self._process.pid is not None:
            shutil.rmtree(partial_dir(self._writing, self._process.pid), ignore_errors=True)

    def wait(self, timeout: float) -> ExportInfo:
        """Block until the job ends; the export, or ExportJobError / ExportCancelledError /
        ExportTimeoutError."""
        deadline = time.monotonic() + timeout
        while not self.done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExportTimeoutError(f"the export did not finish within {timeout:.0f} s "
                                         f"({self.fraction:.0%} done); it is still running")
            self.poll(min(left, 0.5))
        return self._outcome()

    async def async_wait(self, timeout: float, interval: float = 0.1) -> ExportInfo:
        """:meth:`wait` for an asyncio loop (polls without blocking it)."""
        deadline = time.monotonic() + timeout
        while not self.done:
            if time.monotonic() > deadline:
                raise ExportTimeoutError(f"the export did not finish within {timeout:.0f} s "
                                         f"({self.fraction:.0%} done); it is still running")
            self.poll()
            await asyncio.sleep(interval)
        return self._outcome()

    def _outcome(self) -> ExportInfo:
        if self.state == "failed":
            assert self.failure is not None
            raise ExportJobError(self.failure.message, self.failure.kind)
        if self.state == "cancelled":
            raise ExportCancelledError("the export was cancelled; nothing was written. Start it again to export")
        assert self.result is not None
        return self.result

    def cancel(self, timeout: float = CANCEL_TIMEOUT_S) -> bool:
        """Stop the process and remove what it was writing; False if the job had already ended.

        A result that arrived before the process died still counts: the job is then finished.
        """
        if self.done or self._process is None:
            return False
        self._process.terminate()
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
        # What is already in the pipe: the output dir it announced, or a result that beat the signal.
        for event in self._drain(0.0):
            if event is not None:
                self._on_event(event)
        if self.done:
            return False
        self._reap()
        self._remove_partial()
        if self._writing is not None:  # renamed into place just before the signal, but never reported
            shutil.rmtree(self._writing, ignore_errors=True)
        self.state = "cancelled"
        self._on_event(ExportCancelled())
        return True

    def close(self) -> None:
        """Cancel if still running; always release the process."""
        if not self.done:
            self.cancel()
        self._reap()

    def __enter__(self) -> ExportJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
