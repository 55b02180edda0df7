"""The console's one window: the Dashboard (the fleet at a glance), then a page per step from an
empty network to a served model (Fleet, Models, Placement, Distribution, Chat, Metrics), over
the bridge to the fleet service and the controller of the ring it shows.
Closing the window shuts the pages down; the bridge itself is closed by whoever created it
(`console.qt.app.run_console`, or a test)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import QDialog, QMainWindow, QMessageBox, QTabWidget, QVBoxLayout, QWidget

from console.fleet_api.feed import Event, EventKind
from console.qt.banners import NOTICE, WARNING, QtBanner, approval_text, lost_service_text
from console.qt.chat_page import QtChatPage
from console.qt.dashboard_page import QtDashboardPage
from console.qt.distribution_page import QtDistributionPage
from console.qt.first_run_view import QtFirstRunView
from console.qt.first_steps import FleetNow
from console.qt.first_steps_view import QtFirstSteps
from console.qt.fleet_overview import awaiting_approval
from console.qt.fleet_page import QtFleetPage
from console.qt.keys_page import QtKeysPage
from console.qt.metrics_page import QtMetricsPage
from console.qt.models_page import QtModelsPage
from console.qt.placement_page import QtPlacementPage
from console.qt.quick_serve import QuickServe
from console.qt.service_bridge import ServiceBridge
from console.qt.service_serving import ServiceServing, ServingPhase
from console.qt.session import MODEL


class QtFirstRunDialog(QDialog):
    """The first start's welcome: the fleet id and a join token (``view``) in a window of its own."""

    def __init__(self, view: QtFirstRunView, parent: QMainWindow) -> None:
        super().__init__(parent)
        self.setWindowTitle("Deskfleet — your fleet is ready")
        self.view = view
        QVBoxLayout(self).addWidget(view)

class QtConsoleWindow(QMainWindow):
    def __init__(self, bridge: ServiceBridge, *, chat_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.bridge = bridge
        self.serving = ServiceServing(bridge, self)
        self.setWindowTitle(f"Deskfleet console — {bridge.settings.interface}")
        self.resize(1100, 720)
        self.tabs = QTabWidget()
        self.dashboard_page = QtDashboardPage(bridge)
        self.fleet_page = QtFleetPage(bridge)
        self.models_page = QtModelsPage(bridge)
        self.placement_page = QtPlacementPage(bridge)
        self.distribution_page = QtDistributionPage(self.serving, bridge.session)
        self.chat_page = QtChatPage(self.serving, bridge.loop, options=chat_options)
        self.metrics_page = QtMetricsPage(bridge, self.serving)
        self.keys_page = QtKeysPage(bridge, self.serving, self._model_id)
        for page, title in ((self.dashboard_page, "Dashboard"), (self.fleet_page, "Fleet"),
                            (self.models_page, "Models"), (self.placement_page, "Placement"),
                            (self.distribution_page, "Distribution"),
                            (self.chat_page, "Chat"), (self.keys_page, "Keys"), (self.metrics_page, "Metrics")):
            self.tabs.addTab(page, title)
        self.service_banner = QtBanner(WARNING, (("Retry", self.retry_service),))
        self.approval_banner = QtBanner(NOTICE, (("Review", self.review_waiting),
                                                 ("Approve all", self.fleet_page.approve_waiting)))
        central = QWidget()
        column = QVBoxLayout(central)
        column.setContentsMargins(6, 6, 6, 6)
        for widget in (self.service_banner, self.approval_banner):
            column.addWidget(widget)
        column.addWidget(self.tabs, 1)
        self.setCentralWidget(central)
        self.quick_serve = QuickServe(bridge, self.serving, self)
        self.first_steps = QtFirstSteps(self._fleet_now, self.quick_serve, self.show_page,
                                        self.fleet_page.approve_waiting)
        self.dashboard_page.add_first_steps(self.first_steps)
        for signal in (bridge.records_changed, bridge.token_changed, bridge.started):
            signal.connect(self.first_steps.refresh)
        bridge.service_event.connect(self._on_service_event)
        bridge.session.subscribe(lambda what: self.first_steps.refresh() if what == MODEL else None)
        bridge.attached.connect(self._attached)
        bridge.records_changed.connect(lambda records: self.approval_banner.say(approval_text(records)))
        bridge.start_failed.connect(lambda why: self.statusBar().showMessage(f"The console did not start: {why}"))
        bridge.started.connect(lambda: self.statusBar().showMessage(
            f"Fleet {bridge.fleet_id[:16]}… — enrollment {bridge.enrollment}", 0))
        bridge.error.connect(lambda what, why: self.statusBar().showMessage(f"{what} failed: {why}", 15000))
        self.serving.api_ready.connect(lambda url: self.statusBar().showMessage(f"Serving at {url}", 0))
        self.serving.phase_changed.connect(self._on_serving_phase)
        self.first_run_dialog: QtFirstRunDialog | None = None
        self.start_failure: QMessageBox | None = None  # the dialog of a console that could not start
        bridge.started.connect(self._welcome)

    def _on_serving_phase(self, phase: str) -> None:
        if phase == ServingPhase.IDLE and self.statusBar().currentMessage().startswith("Serving at"):
            self.statusBar().showMessage("Nothing is served now.", 0)  # not a stale "Serving at…"

    def _fleet_now(self) -> FleetNow:
        """What the "Get started" checklist reads (the Dashboard keeps the rings and their metrics)."""
        return FleetNow(self.bridge.records, self.dashboard_page.rings, self.dashboard_page.metrics, self.bridge.token,
                        self.bridge.enrollment, self.quick_serve.model_name(), self.quick_serve.busy)

    def _model_id(self) -> str:
        """The model id an API user asks for: a served ring's model, else the one chosen."""
        served = [str(r.get("model", "")) for r in self.dashboard_page.rings.values() if r.get("phase") == "serving"]
        if served:
            return served[0]
        return self.bridge.session.model.name if self.bridge.session.model is not None else ""

    def _on_service_event(self, event: Event) -> None:
        if event.kind in (EventKind.RING, EventKind.RING_REMOVED, EventKind.METRICS):
            self.first_steps.refresh()

    def _attached(self, reached: bool) -> None:
        """The event feed lost (False) or reached again (True) the fleet service."""
        self.service_banner.buttons["Retry"].setEnabled(True)
        self.service_banner.say(None if reached else lost_service_text(self.bridge.settings.service_url, False))
        if reached:
            self.statusBar().showMessage("The fleet service is back.", 10000)

    def retry_service(self) -> None:
        """The banner's Retry: start the local service again (the feed finds it within a second)."""
        self.service_banner.buttons["Retry"].setEnabled(False)
        self.service_banner.say(lost_service_text(self.bridge.settings.service_url, True))

        def failed(exc: BaseException) -> None:
            self.service_banner.buttons["Retry"].setEnabled(True)
            self.service_banner.say(f"The fleet service did not start again: {exc}")

        self.bridge.restart_service(on_result=lambda _: self.service_banner.buttons["Retry"].setEnabled(True),
                                    on_error=failed)

    def review_waiting(self) -> None:
        """The approval banner's Review: the Fleet page with the waiting PCs selected."""
        self.show_page("Fleet")
        self.fleet_page.select({r.key for r in awaiting_approval(self.bridge.records)})

    def _welcome(self) -> None:
        """On the start that created the fleet: say so, with the join token to hand out."""
        if not self.bridge.first_run:
            return
        view = QtFirstRunView(self.bridge.fleet_id, self.bridge.enrollment, self.bridge.issue_token_now)
        dialog = QtFirstRunDialog(view, self)
        self.first_run_dialog = dialog
        dialog.show()

    def page(self, title: str):
        """The page whose tab is ``title``."""
        for i in range(self.tabs.count()):
            if self.tabs.tabText(i) == title:
                return self.tabs.widget(i)
        raise KeyError(title)

    def show_page(self, title: str) -> None:
        self.tabs.setCurrentWidget(self.page(title))

    def shutdown(self) -> None:
        """Stop what the pages run in this process (a chat reply, following an export); what the
        service runs (its exports, its rings) goes on."""
        self.chat_page.shutdown()
        self.models_page.shutdown()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt's name)
        self.shutdown()
        super().closeEvent(event)
