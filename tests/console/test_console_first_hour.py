"""The admin's first hour in the console (issue 32), against a real fleet service on loopback
(pytest-qt, offscreen): a console that starts from an empty library finds the built-in model on
the Models page and has it chosen; the pages follow the service (a lost service shows a banner,
and it goes once the service is back); agents that wait for approval are named so everywhere and
can be approved from a banner; the Dashboard's empty state is a checklist that ticks itself off.
"""

from __future__ import annotations

import pytest

from export.sources import DEFAULT_MODEL_NAME, find_default_gguf
from tests.console.console_app_helpers import fleet_service, item_texts, running_console

pytestmark = pytest.mark.usefixtures("module_dirs")


@pytest.fixture(scope="module")
def service(module_dirs, tmp_path_factory):
    """The module's one fleet service, with an empty library (no model added)."""
    with fleet_service(tmp_path_factory.mktemp("fleet")) as running:
        yield running


@pytest.fixture
def wait(qtbot):
    def wait(condition, timeout: float, what: str) -> None:
        try:
            qtbot.waitUntil(condition, timeout=int(timeout * 1000))
        except AssertionError:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None
    return wait


@pytest.mark.skipif(find_default_gguf() is None, reason="the embedded default model's package is not installed")
def test_the_models_page_lists_the_library_on_arrival_and_chooses_the_default(tmp_path, wait, service):
    with running_console(tmp_path / "console", wait, service) as window:
        page = window.models_page
        wait(lambda: page.model_list.count() > 0, 10, "the model list")
        assert DEFAULT_MODEL_NAME in item_texts(page.model_list)[0]
        assert "built-in default" in item_texts(page.model_list)[0]
        session = window.bridge.session
        assert session.model is not None and session.model.name == DEFAULT_MODEL_NAME
        assert page.model_list.currentRow() == 0 and page.export_button.isEnabled()
        # the Placement page is no dead end: it names the model, not "choose one on the Models page"
        assert DEFAULT_MODEL_NAME in window.placement_page.model_label.text()
        # Refresh reads the library again without dropping the choice
        page.refresh_button.click()
        assert session.model is not None and session.model.name == DEFAULT_MODEL_NAME
        assert page.model_list.currentRow() == 0
