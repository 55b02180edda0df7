"""Calibration on this PC for the fleet service's placement: check the request, time the stages.

The fleet service asks an agent to time one decode step of some stages of a calibration export on a
device (``POST /v1/calibrate``); the agent fetches those stages like any assignment and runs
:mod:`engine.shards.calibration` in a subprocess, so a crash or a hang there never takes the
agent down.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.control.messages import Assignment, ControlRequestError

TIMEOUT_S = 600


@dataclass(frozen=True)
class CalibrationRequest:
    """A checked ``/v1/calibrate`` body: the stages to fetch (as assignments), steps and threads."""

    parts: tuple[Assignment, ...]
    steps: int
    threads: int | None  # the worker's thread count, so the timing is what will serve; None: OpenVINO's

    @property
    def device(self) -> str:
        return self.parts[0].worker.device


def parse_calibration_request(body: dict) -> CalibrationRequest:
    """The request ``body`` asks for; :class:`ControlRequestError` (400) naming the bad field."""
    stages = body.get("stages")
    if not (isinstance(stages, list) and 1 <= len(stages) <= 8
            and all(isinstance(i, int) and not isinstance(i, bool) for i in stages)):
        raise ControlRequestError("stages must be a list of 1-8 stage indices")
    steps = body.get("steps", 16)
    if not (isinstance(steps, int) and 1 <= steps <= 256):
        raise ControlRequestError("steps must be 1..256")
    threads = body.get("threads")
    if threads is not None and not (isinstance(threads, int) and not isinstance(threads, bool)
                                    and 1 <= threads <= 1024):
        raise ControlRequestError("threads must be 1..1024 (or absent: OpenVINO's default)")
    base = {k: body.get(k) for k in ("export_id", "manifest_json", "manifest_sha256", "source")}
    parts = tuple(Assignment.from_dict({**base, "stage": i, "listen_port": 0, "next_hop": "127.0.0.1:1",
                                        "worker": {"device": body.get("device", "CPU")}}) for i in stages)
    return CalibrationRequest(parts=parts, steps=steps, threads=threads)


async def async_time_stages(shard_dir: Path, request: CalibrationRequest) -> list[dict]:
    """Time the request's (fetched) stages in ``shard_dir`` in a subprocess: one dict per stage."""
    stages = ",".join(str(part.stage) for part in request.parts)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine.shards.calibration", "--shard", str(shard_dir),
        "--stages", stages, "--device", request.device, "--steps", str(request.steps),
        *(["--threads", str(request.threads)] if request.threads is not None else []),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise ControlRequestError(f"calibration took longer than {TIMEOUT_S} s", 504) from None
    if proc.returncode != 0:
        raise ControlRequestError(f"calibration failed on {request.device}: "
                                  f"{err.decode(errors='replace')[-400:]}", 500)
    return json.loads(out)
