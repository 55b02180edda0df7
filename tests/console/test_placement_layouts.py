"""The Placement page's layouts, offscreen: each alternative with its predicted tok/s at 1 and N
users, the best proposed and said why; the users expected from the admin's setting or the load
seen; a model no layout holds refused naming its memory. Inputs made up
(tests/console/layouts_screenshot.py), the choice the real one (engine.placement.layouts)."""

from __future__ import annotations

from console.qt.layouts_view import AUTO, QtLayoutsView
from engine.placement.layouts import DEFAULT_USERS
from tests.console.layouts_screenshot import layouts_inputs


def rows(view: QtLayoutsView) -> list[list[str]]:
    t = view.table
    return [[t.item(r, c).text() for c in range(t.columnCount())] for r in range(t.rowCount())]


def test_the_alternatives_are_shown_best_first_with_their_figures_at_1_and_n_users(qtbot):
    view = QtLayoutsView()
    qtbot.addWidget(view)
    assert view.table.rowCount() == 0 and "Place the model" in view.verdict.text()
    view.show_inputs(layouts_inputs())
    view.users.setValue(16)
    shown = rows(view)
    assert shown[0][:3] == ["proposed", "1 copy + 1 ring of 2", "mixed"], shown
    assert {r[1] for r in shown} >= {"2 copies", "1 ring of 3"}
    assert all(r[0] == "" for r in shown[1:])
    header = [view.table.horizontalHeaderItem(c).text() for c in range(view.table.columnCount())]
    assert header[-2:] == ["tok/s, 1 user", "tok/s, 16 users"]
    figures = [float(r[5]) for r in shown]
    assert figures == sorted(figures, reverse=True)
    assert "desk-3" in shown[0][3]
    assert "(unused: desk-3)" in next(r[3] for r in shown if r[1] == "2 copies")
    verdict = view.verdict.text()
    assert verdict.startswith("Proposed for 16 users: 1 copy + 1 ring of 2") and "The best copies layout" in verdict
    assert view.source.text() == "the admin's setting"


def test_one_user_is_proposed_a_copy(qtbot):
    view = QtLayoutsView()
    qtbot.addWidget(view)
    view.show_inputs(layouts_inputs())
    view.users.setValue(1)
    assert rows(view)[0][2] == "copies"


def test_auto_users_follow_the_most_seen_at_once(qtbot):
    view = QtLayoutsView()
    qtbot.addWidget(view)
    view.show_inputs(layouts_inputs())
    assert view.users.value() == AUTO and view.choice is not None and view.choice.users == DEFAULT_USERS
    view.take_metrics({"r1": {"active_streams": 20.0, "waiting_requests": 4.0}, "r2": {"active_streams": 6.0}})
    assert view.choice.users == 30 and view.source.text() == "the most users seen at once"
    view.take_metrics({"r1": {"active_streams": 2.0}})  # fewer now: the peak stays
    assert view.choice.users == 30
    view.users.setValue(3)
    assert view.choice.users == 3


def test_a_model_no_layout_holds_is_refused_naming_its_memory(qtbot):
    view = QtLayoutsView()
    qtbot.addWidget(view)
    view.show_inputs(layouts_inputs((2, 2), total_gb=10.0))
    assert view.table.rowCount() == 0
    text = view.verdict.text()
    assert text.startswith("No layout holds this model: the model needs 10.00 GB") and "desk-1" in text, text
