"""What the data-plane insider, bound and hold tests share: one fleet CA with its members, and
the tiny model's 1-stage export served by a real paged stage (one of each per test module)."""

from __future__ import annotations

import pytest

from engine.paged.stage import PagedStage
from tests.security.dataplane_helpers import make_fleet


@pytest.fixture(scope="module")
def fleet():
    """The console, the desk serving the stage, and two fellow members (mallory, bob), one CA."""
    return make_fleet()


@pytest.fixture(scope="module")
def export(tiny_export):
    """The tiny llama as one stage."""
    return tiny_export("llama", 1)


@pytest.fixture(scope="module")
def stage(export):
    """That stage loaded paged (exact f32), ready for a PagedStageWorker (its pool is allocated by
    the first Step of a ring)."""
    return PagedStage(export, 0, exact=True)
