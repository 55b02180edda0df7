"""The Models page: the models the admin can export (the embedded default, added HF checkpoint
directories and GGUF files), the export format, the exports already made with their manifests,
and an export of the chosen model with a progress bar and Cancel.

The model library and its exports live in the fleet service (read through the bridge); an export
runs there as a job whose progress arrives through the service's event feed
(:class:`console.qt.service_export.ServiceExportJob`). The chosen model and format go into the
console session, which the Placement and Distribution pages follow.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import (
    ExportCancelled,
    ExportEvent,
    ExportFailed,
    ExportFinished,
    ExportInfo,
    ExportProgress,
    ExportSpec,
)
from console.fleet_api.feed import Event, EventKind
from console.fleet_api.model_entry import ModelEntry
from console.qt.first_steps import default_model
from console.qt.service_bridge import ServiceBridge
from console.qt.service_export import ServiceExportJob
from engine.shards.manifest import MANIFEST_NAME

ROLE = Qt.ItemDataRole.UserRole
WEIGHTS = ("int4", "int8", "fp16", "fp32")
EXPORT_COLUMNS = ("Export", "Model", "Weights", "Stages", "Layers", "Size", "Created")


def model_label(entry: ModelEntry) -> str:
    """A model's line in the list: name, what it is, and whether it can be exported."""
    kind = {"default": "built-in default", "hf": "HF checkpoint", "gguf": "GGUF file"}.get(entry.kind, entry.kind)
    label = f"{entry.name}  ({kind}{'' if entry.available else ', not available'})"
    if entry.path is not None:
        label += f" — {entry.path}"
    elif not entry.available:
        label += " — its package is not installed on the service's PC (`deskfleet models` says how)"
    return label


class QtModelsPage(QWidget):
    def __init__(self, bridge: ServiceBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.library = bridge.library
        self.job: ServiceExportJob | None = None
        self._timer = QTimer(self)
        self._timer.setInterval(100)
        self._timer.timeout.connect(self._poll)
        self._build()
        # The library lives in the service: read it once attached (and again after a restart of
        # the service), and whenever an export ends there (this console's or another's).
        bridge.started.connect(self.reload)
        bridge.attached.connect(self._on_attached)
        bridge.service_event.connect(self._on_service_event)
        self.reload()

    def _build(self) -> None:
        self.model_list = QListWidget()
        self.model_list.currentItemChanged.connect(lambda *_: self._choose())
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.setToolTip("Read the model library and the exports from the fleet service again")
        self.refresh_button.clicked.connect(self.reload)
        self.library_label = QLabel("Models")
        self.path_edit = QLineEdit()
        self.path_edit.setPlaceholderText("an HF checkpoint directory or a .gguf file")
        self.path_edit.returnPressed.connect(self.add_path)
        self.add_button = QPushButton("Add")
        self.add_button.clicked.connect(self.add_path)
        self.browse_dir_button = QPushButton("HF directory…")
        self.browse_dir_button.clicked.connect(self._browse_dir)
        self.browse_gguf_button = QPushButton("GGUF file…")
        self.browse_gguf_button.clicked.connect(self._browse_gguf)
        add = QHBoxLayout()
        add.addWidget(self.path_edit, 1)
        for b in (self.add_button, self.browse_dir_button, self.browse_gguf_button):
            add.addWidget(b)

        self.weights = QComboBox()
        self.weights.addItems(WEIGHTS)
        self.weights.currentTextChanged.connect(lambda _: self._choose())
        self.stages = QSpinBox()
        self.stages.setRange(1, 64)
        self.stages.setValue(2)
        self.export_button = QPushButton("Export")
        self.export_button.clicked.connect(self.export)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress_label = QLabel()
        self.progress_label.setWordWrap(True)
        export = QHBoxLayout()
        export.addWidget(QLabel("Weights:"))
        export.addWidget(self.weights)
        export.addWidget(QLabel("Stages:"))
        export.addWidget(self.stages)
        export.addWidget(self.export_button)
        export.addWidget(self.progress, 1)
        export.addWidget(self.cancel_button)

        self.exports_table = QTableWidget(0, len(EXPORT_COLUMNS))
        self.exports_table.setHorizontalHeaderLabels(EXPORT_COLUMNS)
        self.exports_table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.exports_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.exports_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.exports_table.itemSelectionChanged.connect(self._show_manifest)
        self.manifest_view = QPlainTextEdit()
        self.manifest_view.setReadOnly(True)
        self.manifest_view.setPlaceholderText("Select an export to see its manifest")

        top = QWidget()
        top_box = QVBoxLayout(top)
        top_box.setContentsMargins(0, 0, 0, 0)
        heading = QHBoxLayout()
        heading.addWidget(self.library_label, 1)
        heading.addWidget(self.refresh_button)
        top_box.addLayout(heading)
        top_box.addWidget(QLabel("Export makes the model's stage files; the Placement page decides how many "
                                 "stages and on which PCs, and Distribution exports (or reuses) what the plan "
                                 "needs — you need not export here first."))
        top_box.addWidget(self.model_list, 1)
        top_box.addLayout(add)
        top_box.addLayout(export)
        top_box.addWidget(self.progress_label)
        bottom = QSplitter()
        bottom.addWidget(self.exports_table)
        bottom.addWidget(self.manifest_view)
        bottom.setSizes([560, 360])
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(top)
        splitter.addWidget(bottom)
        box = QVBoxLayout(self)
        box.addWidget(splitter)
        self._update_buttons()

    # ---- models ----------------------------------------------------------------------------------

    def reload(self) -> None:
        """Redraw the models and the exports from the library; with no model chosen yet, choose
        the default one (the embedded model when installed), as the Placement page needs one."""
        if not self.bridge.running:
            self.library_label.setText("Models — waiting for the fleet service…")
            return
        try:
            models = self.library.models()
        except Exception as exc:  # the service went away between the check and the read
            self._say(f"Could not read the model library: {exc}", error=True)
            return
        current = self.bridge.session.model
        self.model_list.blockSignals(True)
        self.model_list.clear()
        for entry in models:
            item = QListWidgetItem(model_label(entry))
            item.setData(ROLE, entry)
            self.model_list.addItem(item)
            if entry == current:
                self.model_list.setCurrentItem(item)
        self.model_list.blockSignals(False)
        self.library_label.setText(f"Models in the fleet's library: {len(models)}")
        self._fill_exports()
        if current is None and (default := default_model(models)) is not None:
            self.select_model(default)

    def _on_attached(self, reached: bool) -> None:
        if reached:  # the service is back (perhaps restarted, perhaps another library)
            self.reload()

    def _on_service_event(self, event: Event) -> None:
        if event.kind is EventKind.EXPORT and event.data.get("state") in ("finished", "cancelled"):
            self.reload()

    def select_model(self, entry: ModelEntry) -> None:
        for i in range(self.model_list.count()):
            if self.model_list.item(i).data(ROLE) == entry:
                self.model_list.setCurrentRow(i)

    def _choose(self) -> None:
        item = self.model_list.currentItem()
        entry = item.data(ROLE) if item is not None else None
        self.bridge.session.choose_model(entry, ExportSpec(weights=self.weights.currentText()))
        self._update_buttons()

    def add_path(self, path: str | Path | None = None) -> ModelEntry | None:
        text = str(path) if path else self.path_edit.text().strip()
        try:
            entry = self.library.add_model(text)
        except FleetServiceError as exc:
            self._say(str(exc), error=True)
            return None
        self.path_edit.clear()
        self.reload()
        self.select_model(entry)
        self._say(f"Added {entry.name}.")
        return entry

    def _browse_dir(self) -> None:
        if path := QFileDialog.getExistingDirectory(self, "HF checkpoint directory"):
            self.add_path(path)

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GGUF file", "", "GGUF models (*.gguf)")
        if path:
            self.add_path(path)

    # ---- exports ---------------------------------------------------------------------------------

    def _fill_exports(self) -> None:
        exports = self.library.exports()
        self.exports_table.setRowCount(len(exports))
        for row, e in enumerate(exports):
            layers = ", ".join(f"{a}-{b}" for a, b in e.layers)
            values = (e.export_id, e.name, e.weights, str(e.stages), layers, f"{e.size_bytes / 1e6:.1f} MB", e.created)
            for col, value in enumerate(values):
                item = QTableWidgetItem(value)
                item.setData(ROLE, e)
                self.exports_table.setItem(row, col, item)

    def _show_manifest(self) -> None:
        items = self.exports_table.selectedItems()
        if not items:
            return
        info: ExportInfo = items[0].data(ROLE)
        try:
            self.manifest_view.setPlainText((info.path / MANIFEST_NAME).read_text(encoding="utf-8"))
        except OSError as exc:
            self.manifest_view.setPlainText(f"cannot read the manifest: {exc}")

    def export(self) -> None:
        entry = self.bridge.session.model
        if entry is None or (self.job is not None and not self.job.done):
            return
        self.progress.setValue(0)
        try:
            self.job = self.library.start_export(entry, stages=self.stages.value(), spec=self.bridge.session.spec,
                                                 on_event=self._on_event)
        except FleetServiceError as exc:
            self._say(str(exc), error=True)
            return
        self._say(f"Exporting {entry.name}…")
        self._timer.start()
        self._update_buttons()

    def cancel(self) -> None:
        if self.job is not None and not self.job.done:
            self.job.cancel()

    def _poll(self) -> None:
        if self.job is None or self.job.done:
            self._timer.stop()
        else:
            self.job.poll()

    def _on_event(self, event: ExportEvent) -> None:
        if isinstance(event, ExportProgress):
            self.progress.setValue(int(1000 * event.fraction))
            where = "preparing" if event.stage is None else f"stage {event.stage}"
            self._say(f"Exporting: {where}, {event.step}…")
        elif isinstance(event, ExportFinished):
            self.progress.setValue(1000)
            self._say(f"{'Reused' if event.reused else 'Exported'} {event.export.export_id} "
                      f"in {event.seconds:.0f} s.")
            self._fill_exports()
        elif isinstance(event, ExportFailed):
            self._say(f"The export failed: {event.message}", error=True)
        elif isinstance(event, ExportCancelled):
            self.progress.setValue(0)
            self._say("The export was cancelled; nothing was written.")
            self._fill_exports()
        self._update_buttons()

    def _say(self, text: str, error: bool = False) -> None:
        self.progress_label.setStyleSheet("color: #b3261e;" if error else "")
        self.progress_label.setText(text)

    def _update_buttons(self) -> None:
        busy = self.job is not None and not self.job.done
        self.export_button.setEnabled(not busy and self.bridge.session.model is not None)
        self.cancel_button.setEnabled(busy)

    def shutdown(self) -> None:
        """Stop following a running export (it goes on in the service: closing the console stops nothing)."""
        self._timer.stop()
        if self.job is not None:
            self.job.close()
