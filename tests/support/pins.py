"""The version pins of pyproject.toml, for code that runs from a clone and must install the same
versions (the optimum reference's environment) or check that nothing else repeats them.

pyproject.toml is the one place a version is written (installer/bootstrap.sh reads it the same
way); the embedded default model's pin is export.sources.DEFAULT_REQUIREMENT.
"""

from __future__ import annotations

import functools
import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@functools.cache
def declared() -> tuple[str, ...]:
    """Every requirement pyproject.toml declares: the dependencies, then each extra's."""
    with PYPROJECT.open("rb") as f:
        project = tomllib.load(f)["project"]
    extras = project.get("optional-dependencies", {})
    return tuple(project["dependencies"]) + tuple(r for reqs in extras.values() for r in reqs)


def pinned(name: str) -> str:
    """The ``name==version`` requirement pyproject.toml pins ``name`` at ("torch" -> "torch==<version>");
    LookupError unless it is pinned with ``==`` exactly once."""
    pins = {r.split(";")[0].strip() for r in declared()
            if re.match(rf"{re.escape(name)}\s*==", r, re.IGNORECASE)}
    if len(pins) != 1:
        raise LookupError(f"pyproject.toml pins {name} {len(pins)} ways ({sorted(pins)}); pin it once with ==")
    return pins.pop()
