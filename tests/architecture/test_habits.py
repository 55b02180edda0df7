"""Nothing dropped silently (STYLE.md, principle 15), as a ratchet: background tasks start through
``engine.tasks.start_task`` and a swallowed ``Exception`` goes through
``engine.suppress.logged_suppress``. The files below still hold the old idioms; none may hold more,
and no other file may start one. Lower an entry when its file is converted."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "agent", "export", "console", "installer")
TASK = re.compile(r"\bcreate_task\(|\bensure_future\(")
SUPPRESS_ALL = re.compile(r"\bsuppress\((Base)?Exception\b")

# Tasks awaited where they are made (a gather, an as_completed, a wait on two futures): not
# background tasks, nothing to hold or log beyond what the awaiting code does.
STRUCTURED_TASKS = {
    "engine/api/fan_in.py": 1, "engine/cli/doctor.py": 2, "engine/tools/local_supervisor.py": 1,
    "engine/tools/wan_emulator.py": 1, "agent/service/fleet_link.py": 1,
    "engine/paged/coordinator.py": 2,
    "engine/worker/serve_worker.py": 1,  # a spare waits on its activation or the stop, whichever comes first
}
# Background tasks still started by hand: none (a new one starts through engine.tasks.start_task).
PENDING_TASKS: dict[str, int] = {}
PENDING_SUPPRESS: dict[str, int] = {}


def _counts(pattern: re.Pattern[str], skip: set[str]) -> dict[str, int]:
    counts = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in skip:
                continue
            code = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
            n = sum(len(pattern.findall(line)) for line in code)
            if n:
                counts[rel] = n
    return counts


def _over(counts: dict[str, int], allowed: dict[str, int]) -> list[str]:
    return [f"{path}: {n} (allowed {allowed.get(path, 0)})" for path, n in counts.items() if n > allowed.get(path, 0)]


def test_background_tasks_start_through_start_task() -> None:
    allowed = {p: STRUCTURED_TASKS.get(p, 0) + PENDING_TASKS.get(p, 0) for p in {*STRUCTURED_TASKS, *PENDING_TASKS}}
    over = _over(_counts(TASK, {"engine/tasks.py"}), allowed)
    assert not over, ("start a background task with engine.tasks.start_task (named, held, its exception "
                      "logged), not create_task/ensure_future:\n" + "\n".join(over))


def test_a_swallowed_exception_is_logged() -> None:
    over = _over(_counts(SUPPRESS_ALL, {"engine/suppress.py"}), PENDING_SUPPRESS)
    assert not over, ("use engine.suppress.logged_suppress(log, what) instead of suppress(Exception), or "
                      "suppress the one error you expect:\n" + "\n".join(over))


def test_the_ratchet_catches_a_new_site(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import asyncio, contextlib\n# asyncio.create_task(x) in a comment\n"
                      "def f(c):\n    with contextlib.suppress(Exception):\n        asyncio.create_task(c)\n")
    code = [line for line in sample.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert sum(len(TASK.findall(line)) for line in code) == 1
    assert sum(len(SUPPRESS_ALL.findall(line)) for line in code) == 1
    assert _over({"x.py": 1}, {}) == ["x.py: 1 (allowed 0)"]
