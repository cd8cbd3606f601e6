"""New agent session: which folder the agent works in, and what its commands can reach."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.agents import proposed_workspace
from backend import api


class NewAgentDialog(QDialog):
    """``workspace()``: the chosen folder, created on OK when it does not exist yet."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("New agent session")
        self.path = QLineEdit(proposed_workspace())
        self.path.setMinimumWidth(420)
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        row = QHBoxLayout()
        row.addWidget(self.path, 1)
        row.addWidget(browse)
        note = QLabel(
            "The agent reads files there freely and asks before it writes, edits or runs a "
            f"command. Commands are {api.describe_isolation()}."
        )
        note.setWordWrap(True)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self._accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Workspace folder:"))
        layout.addLayout(row)
        layout.addWidget(note)
        layout.addWidget(buttons)

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Workspace folder", self.path.text())
        if folder:
            self.path.setText(folder)

    def workspace(self) -> str:
        """The folder as an absolute path (a relative one would follow the app's cwd)."""
        return str(Path(self.path.text().strip()).expanduser().resolve())

    def _accept(self) -> None:
        if not self.path.text().strip():
            QMessageBox.warning(self, "Workspace", "Choose a folder for the agent to work in")
            return
        folder = Path(self.workspace())
        if folder == Path(folder.anchor) or folder == Path.home().resolve():
            QMessageBox.warning(
                self, "Workspace", f"{folder} is too broad for a workspace: pick a project folder"
            )
            return
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            QMessageBox.warning(self, "Workspace", f"Cannot use {folder}: {exc.strerror or exc}")
            return
        if not folder.is_dir():
            QMessageBox.warning(self, "Workspace", f"{folder} is not a folder")
            return
        self.accept()
