"""The model manager: local models (the one in use marked), adding a GGUF file or HF
folder, removing one from the list, getting the demo MoE.

A model is checked when it is added, so one that cannot be used is reported at once and
never listed; building the demo runs on a worker thread, keeping the window responsive.
Removing asks first, never touches a user's own file (only its link in the list), and
refuses the model in use.
"""

from __future__ import annotations

import threading
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from backend import api
from backend.api import BevyError

COLUMNS = ("Name", "Status", "Architecture", "Experts/layer", "Top-k", "Quant", "Size", "Path")


class ModelManager(QDialog):
    use_model = Signal(str)  # path chosen with "Use selected"
    _demo_done = Signal(str, str)  # path, error

    def __init__(self, parent: QWidget | None = None, in_use: str | None = None) -> None:
        """``in_use``: the path of the model the engine runs now."""
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(940, 360)
        self.in_use = str(Path(in_use).resolve()) if in_use else None
        self.error_box: QMessageBox | None = None
        self.confirm_box: QMessageBox | None = None
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(
            len(COLUMNS) - 1, QHeaderView.ResizeMode.Stretch
        )
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # the demo build reports no fraction: a busy bar
        self.progress.hide()
        self.status = QLabel()
        add_file = QPushButton("Add GGUF file…")
        add_file.clicked.connect(self._browse_file)
        add_dir = QPushButton("Add HF folder…")
        add_dir.clicked.connect(self._browse_dir)
        self.demo_button = QPushButton("Get demo MoE")
        self.demo_button.setToolTip(
            "Builds the 32-expert demo from SmolLM2-135M (about 1.5 GiB, under a minute)"
        )
        self.demo_button.clicked.connect(self.get_demo)
        self.remove_button = QPushButton("Remove…")
        self.remove_button.setToolTip(
            "Takes the model off this list; your file stays where it is "
            "(the demo MoE's built file is deleted, and can be built again)"
        )
        self.remove_button.clicked.connect(self.remove_selected)
        use = QPushButton("Use selected")
        use.clicked.connect(self._use_selected)
        buttons = QHBoxLayout()
        for b in (add_file, add_dir, self.demo_button, self.remove_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(use)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addLayout(buttons)
        self._demo_done.connect(self._on_demo_done)
        self.refresh()

    def refresh(self) -> None:
        entries = api.list_models()
        self.table.setRowCount(len(entries))
        for row, e in enumerate(entries):
            in_use = self.in_use is not None and str(e.path.resolve()) == self.in_use
            cells = (
                e.name,
                "in use" if in_use else f"unreadable: {e.error}" if e.error else "",
                e.family,
                str(e.experts_per_layer),
                str(e.top_k),
                e.quant,
                api.format_size(e.size_bytes),
                str(e.path),
            )
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, str(e.path))
                if in_use:
                    font = item.font()
                    font.setBold(True)
                    item.setFont(font)
                self.table.setItem(row, col, item)
        self.table.resizeColumnsToContents()
        self.status.setText(f"{len(entries)} local model(s)")

    def paths(self) -> list[str]:
        return [
            self.table.item(r, 0).data(Qt.ItemDataRole.UserRole)
            for r in range(self.table.rowCount())
        ]

    # --- adding -------------------------------------------------------------------------

    def _browse_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Add a GGUF model", "", "GGUF (*.gguf)")
        if path:
            self.add_path(path)

    def _browse_dir(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Add a Hugging Face model folder")
        if path:
            self.add_path(path)

    def add_path(self, path: str | Path) -> bool:
        """Validate and register a model; a bad one shows an error and changes nothing."""
        try:
            entry = api.add_model(path)
        except BevyError as exc:
            self.show_error("This model cannot be used", str(exc))
            return False
        self.refresh()
        self.status.setText(
            f"Added {entry.name}: {entry.family}, {entry.experts_per_layer} experts, top-{entry.top_k}"
        )
        return True

    # --- removing -----------------------------------------------------------------------

    def remove_selected(self) -> None:
        """Ask, then take the selected model off the list."""
        row = self.table.currentRow()
        if row < 0:
            self.status.setText("Select a model to remove")
            return
        path = self.table.item(row, 0).data(Qt.ItemDataRole.UserRole)
        if self._refuse_in_use(path):
            return
        demo = Path(path).resolve() == api.demo_path().resolve()
        what = (
            "Delete the demo MoE's built file? Get demo MoE builds it again."
            if demo
            else f"Remove {Path(path).name} from the list? The model itself stays at {path}."
        )
        self.confirm_box = QMessageBox(
            QMessageBox.Icon.Question,
            "Remove model",
            what,
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel,
            self,
        )
        box = self.confirm_box
        box.buttonClicked.connect(
            lambda b: (
                box.standardButton(b) == QMessageBox.StandardButton.Yes and self.remove_path(path)
            )
        )
        self.confirm_box.open()

    def _refuse_in_use(self, path: str) -> bool:
        if self.in_use is not None and str(Path(path).resolve()) == self.in_use:
            self.show_error(
                "This model is in use",
                "The engine runs this model now; choose another one (Use selected, or "
                "Settings) before removing it.",
            )
            return True
        return False

    def remove_path(self, path: str | Path) -> bool:
        """Take ``path`` off the list (no question asked); an error is shown."""
        if self._refuse_in_use(str(path)):
            return False
        try:
            done = api.remove_model(path)
        except (BevyError, OSError) as exc:
            self.show_error("Could not remove the model", str(exc))
            return False
        self.refresh()
        self.status.setText(done)
        return True

    def show_error(self, title: str, text: str) -> None:
        # open(), not exec(): the dialog stays usable and nothing blocks the event loop.
        self.error_box = QMessageBox(QMessageBox.Icon.Warning, title, text, parent=self)
        self.error_box.open()

    def get_demo(self) -> None:
        self.demo_button.setEnabled(False)
        self.progress.show()
        self.status.setText("Building the demo MoE (download, calibration, writing)…")

        def work() -> None:
            try:
                self._demo_done.emit(str(api.ensure_demo(quiet=True)), "")
            except Exception as exc:  # network, disk full: shown, never a crash
                self._demo_done.emit("", str(exc))

        threading.Thread(target=work, name="bevy-demo", daemon=True).start()

    def _on_demo_done(self, path: str, error: str) -> None:
        self.progress.hide()
        self.demo_button.setEnabled(True)
        if error:
            self.show_error("Could not get the demo MoE", error)
            return
        self.refresh()
        self.status.setText(f"Demo MoE ready: {path}")

    def _use_selected(self) -> None:
        row = self.table.currentRow()
        if row >= 0:
            self.use_model.emit(self.table.item(row, 0).data(Qt.ItemDataRole.UserRole))
            self.accept()
