"""Model → Engines: the remote engines (OpenAI-compatible servers) sessions can run on.

Each has a name, a base URL, an API key and a model picked from the server's own list
(fetched on a worker thread, so a slow or dead server never freezes the window; what
went wrong is shown in the dialog). Where keys are kept is said plainly, with a warning
when no system keyring is there to hold them.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from backend import api
from backend.api import Endpoint

EXAMPLES = (
    "Any OpenAI-compatible server: vLLM or SGLang (http://gpu-box:8000/v1), llama.cpp's "
    "llama-server (http://host:8080/v1), LM Studio (http://host:1234/v1) or Bevy on "
    "another machine (bevy serve --host 0.0.0.0)."
)


class EnginesDialog(QDialog):
    """Edits a list of endpoints; ``engines()`` is the result once accepted."""

    _fetched = Signal(int, object, str)  # request number, model ids or None, error

    def __init__(
        self,
        engines: list[Endpoint],
        key_place: str,
        key_secure: bool,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Engines")
        self.resize(720, 420)
        self._engines = list(engines)
        self._origins: list[str | None] = [e.name for e in engines]  # None: added here
        self._fetch_no = 0
        self.list = QListWidget()
        self.list.currentRowChanged.connect(self._show)
        add = QPushButton("Add")
        add.clicked.connect(self.add_engine)
        self.remove_button = QPushButton("Remove")
        self.remove_button.clicked.connect(self.remove_engine)
        self.name = QLineEdit(placeholderText="gpu-box")
        self.url = QLineEdit(placeholderText="http://gpu-box:8000/v1")
        self.key = QLineEdit(placeholderText="none")
        self.key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.model = QComboBox()
        self.model.setEditable(True)
        self.fetch_button = QPushButton("Get models")
        self.fetch_button.setToolTip("Ask the server for its models (GET /v1/models)")
        self.fetch_button.clicked.connect(self.fetch_models)
        self.status = QLabel(wordWrap=True)
        for field in (self.name, self.url, self.key):
            field.textEdited.connect(self._edited)
        self.model.editTextChanged.connect(self._edited)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model, 1)
        model_row.addWidget(self.fetch_button)
        form = QFormLayout()
        form.addRow("Name", self.name)
        form.addRow("Base URL", self.url)
        form.addRow("API key", self.key)
        form.addRow("Model", model_row)
        form.addRow("", self.status)
        note = QLabel(EXAMPLES, wordWrap=True)
        keys = QLabel(f"API keys are kept in {key_place}.", wordWrap=True)
        if not key_secure:
            keys.setStyleSheet("color: #b05a00")
        self.error = QLabel(wordWrap=True)
        self.error.setStyleSheet("color: #d9534f")
        side = QVBoxLayout()
        side.addWidget(self.list, 1)
        row = QHBoxLayout()
        row.addWidget(add)
        row.addWidget(self.remove_button)
        side.addLayout(row)
        top = QHBoxLayout()
        top.addLayout(side, 1)
        top.addLayout(form, 2)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(top, 1)
        for w in (note, keys, self.error, buttons):
            layout.addWidget(w)
        self._fetched.connect(self._on_fetched)
        for e in self._engines:
            self.list.addItem(e.name)
        self.list.setCurrentRow(0 if self._engines else -1)
        self._show(self.list.currentRow())

    # --- the list -----------------------------------------------------------------------

    def add_engine(self) -> None:
        taken = {e.name for e in self._engines}
        name = next(f"engine {i}" for i in range(1, len(taken) + 2) if f"engine {i}" not in taken)
        self._engines.append(Endpoint(name, "http://127.0.0.1:8000/v1"))
        self._origins.append(None)
        self.list.addItem(name)
        self.list.setCurrentRow(len(self._engines) - 1)
        self.name.setFocus()
        self.name.selectAll()

    def remove_engine(self) -> None:
        row = self.list.currentRow()
        if row >= 0:
            del self._engines[row]
            del self._origins[row]
            self.list.takeItem(row)

    def _show(self, row: int) -> None:
        self._fetch_no += 1  # models asked for another row's engine are not shown here
        self.fetch_button.setEnabled(True)
        editing = 0 <= row < len(self._engines)
        for w in (self.name, self.url, self.key, self.model, self.fetch_button):
            w.setEnabled(editing)
        self.remove_button.setEnabled(editing)
        e = self._engines[row] if editing else Endpoint("", "")
        for field, value in ((self.name, e.name), (self.url, e.base_url), (self.key, e.api_key)):
            field.blockSignals(True)
            field.setText(value)
            field.blockSignals(False)
        self.model.blockSignals(True)
        self.model.clear()
        if e.model:
            self.model.addItem(e.model)
        self.model.setEditText(e.model)
        self.model.blockSignals(False)
        self.status.setText("")

    def _edited(self) -> None:
        row = self.list.currentRow()
        if not 0 <= row < len(self._engines):
            return
        self._engines[row] = Endpoint(
            self.name.text().strip(),
            self.url.text().strip(),
            self.model.currentText().strip(),
            self.key.text().strip(),
        )
        self.list.item(row).setText(self._engines[row].name or "(no name)")

    # --- asking the server for its models -----------------------------------------------

    def fetch_models(self) -> None:
        row = self.list.currentRow()
        if not 0 <= row < len(self._engines):
            return
        self._fetch_no += 1
        number, engine = self._fetch_no, self._engines[row]
        self.status.setText(f"Asking {engine.api_base} for its models…")
        self.fetch_button.setEnabled(False)

        def work() -> None:
            try:
                self._fetched.emit(number, api.remote_models(engine), "")
            except api.BevyError as exc:
                self._fetched.emit(number, None, str(exc))
            except Exception as exc:  # a URL the client cannot use, and the like
                self._fetched.emit(number, None, f"{engine.api_base}: {exc}")

        threading.Thread(target=work, name="bevy-engine-models", daemon=True).start()

    def _on_fetched(self, number: int, models: list[str] | None, error: str) -> None:
        if number != self._fetch_no:
            return  # a newer request went out since
        self.fetch_button.setEnabled(True)
        if models is None:
            self.status.setText(error)
            return
        current = self.model.currentText().strip()
        self.model.blockSignals(True)
        self.model.clear()
        self.model.addItems(models)
        self.model.blockSignals(False)
        self.model.setCurrentText(current if current in models else (models[0] if models else ""))
        self._edited()
        self.status.setText(
            f"{len(models)} model{'s' if len(models) != 1 else ''} on this server"
            if models
            else "The server lists no models"
        )

    # --- result -------------------------------------------------------------------------

    def engines(self) -> list[Endpoint]:
        return list(self._engines)

    def renames(self) -> dict[str, str]:
        """Old name -> new name of each engine renamed here (its sessions follow it)."""
        return {
            old: e.name
            for old, e in zip(self._origins, self._engines, strict=True)
            if old is not None and old != e.name
        }

    def accept(self) -> None:
        names = [e.name for e in self._engines]
        if any(not n for n in names):
            self.error.setText("Every engine needs a name.")
            return
        if len(set(names)) != len(names):
            self.error.setText("Two engines have the same name.")
            return
        bad = [e.name for e in self._engines if not e.base_url.startswith(("http://", "https://"))]
        if bad:
            self.error.setText(f"{bad[0]}: the base URL must start with http:// or https://")
            return
        super().accept()
