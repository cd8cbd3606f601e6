"""Settings: model, device, storage tier, cache size, policy, concurrency, sampling, API.

OK checks the values the way the engine will read them and shows what is wrong in the
dialog, so a bad value is refused here instead of failing the next engine load.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.settings import (
    DEVICES,
    OVERFLOWS,
    POLICIES,
    STORAGES,
    engine_config,
    sampling,
    with_profile,
)
from backend.api import AUTO, POLICY_NOTES, system_memory

OVERFLOW_TEXT = {
    "rolling": "drop the oldest turns (keep the system prompt)",
    "truncate_middle": "drop turns from the middle (keep the first one)",
    "error": "stop with an error",
}


def _combo(values: tuple[str, ...], current: str) -> QComboBox:
    box = QComboBox()
    box.addItems(list(values))
    box.setCurrentText(current)
    return box


class SettingsDialog(QDialog):
    """Edits a settings dict; ``values()`` is the result once accepted."""

    def __init__(
        self,
        settings: dict,
        models: list[str],
        parent: QWidget | None = None,
        entries: dict | None = None,
        profiles: dict | None = None,
    ) -> None:
        """``entries``: the models' catalog entries by path ("" for the demo MoE), for
        what a cache size costs in memory; ``profiles``: each model's remembered
        settings (``settings.MODEL_KEYS``), shown when that model is chosen."""
        super().__init__(parent)
        self._entries = dict(entries or {})
        self._profiles = dict(profiles or {})
        self.setWindowTitle("Settings")
        self._settings = dict(settings)
        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.addItem("(demo MoE)", "")
        for path in models:
            self.model.addItem(path, path)
        current = settings["model"]
        if current and self.model.findData(current) < 0:
            self.model.addItem(current, current)
        self.model.setCurrentIndex(max(0, self.model.findData(current)))
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model, 1)
        model_row.addWidget(browse)
        self.device = _combo(DEVICES, settings["device"])
        self.storage = _combo(STORAGES, settings["storage"])
        self.storage.setToolTip(
            "ssd: experts are read from the model file on demand (O_DIRECT); host: all in RAM"
        )
        self.cache = QLineEdit(str(settings["cache"]))
        self.cache.setToolTip(
            "auto (every expert where they fit in free memory, else what fits), a share "
            "of all experts (30%), a count (288) or a size (512MiB)"
        )
        self.memory = QLineEdit(
            str(settings["memory"]), placeholderText="none (4GiB, or 60% of the RAM)"
        )
        self.memory.setToolTip(
            "One total for the app's process: the window, runtime, dense weights, expert "
            "cache, KV and scratch. The expert cache gets what the rest leaves, whatever a "
            "model's own cache size."
        )
        self.memory.textChanged.connect(self._show_cache_cost)
        self.cache_cost = QLabel()
        self.cache_cost.setStyleSheet("color: palette(mid)")
        self.cache.textChanged.connect(self._show_cache_cost)
        self.model.currentIndexChanged.connect(self._show_cache_cost)
        self.model.editTextChanged.connect(self._show_cache_cost)
        self.policy = _combo(POLICIES, settings["policy"])
        self.policy_note = QLabel(wordWrap=True)
        self.policy.currentTextChanged.connect(lambda p: self._set_note(POLICY_NOTES.get(p, "")))
        self._set_note(POLICY_NOTES.get(settings["policy"], ""))
        self.overflow = QComboBox()
        for key in OVERFLOWS:
            self.overflow.addItem(OVERFLOW_TEXT[key], key)
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(settings["context_overflow"])))
        self.overflow.setToolTip("A session can choose otherwise in its own settings")
        self.model.currentIndexChanged.connect(self._show_profile)
        self.max_active = QSpinBox(minimum=1, maximum=64, value=int(settings["max_active"]))
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2)
        self.temperature.setValue(float(settings["temperature"]))
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05, decimals=2)
        self.top_p.setValue(float(settings["top_p"]))
        self.max_tokens = QSpinBox(minimum=1, maximum=32768, value=int(settings["max_tokens"]))
        self.api_enabled = QCheckBox(
            "Serve this engine to other apps (OpenAI, Ollama, Anthropic APIs)"
        )
        self.api_enabled.setToolTip(
            "One server answers OpenAI clients at /v1, Ollama clients (Open WebUI, Continue, "
            "Zed) at the root, and Anthropic-SDK agents (Claude Code) at /v1/messages. "
            "They share this engine and its expert cache with your sessions."
        )
        self.api_enabled.setChecked(bool(settings["api_enabled"]))
        self.api_port = QSpinBox(minimum=1, maximum=65535, value=int(settings["api_port"]))
        self.api_key = QLineEdit(
            settings["api_key"], placeholderText="optional (Bearer token or x-api-key)"
        )
        self.api_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.error = QLabel(wordWrap=True)
        self.error.setStyleSheet("color: #d9534f")

        engine = QGroupBox("Engine (applying reloads it; conversations are kept)")
        form = QFormLayout(engine)
        form.addRow("Model", model_row)
        form.addRow("Device", self.device)
        form.addRow("Max concurrent requests", self.max_active)
        form.addRow("Memory limit", self.memory)
        own = QGroupBox("This model (remembered for it, used whenever it loads)")
        form = QFormLayout(own)
        form.addRow("Expert storage", self.storage)
        form.addRow("Expert cache", self.cache)
        form.addRow("", self.cache_cost)
        form.addRow("Policy", self.policy)
        form.addRow("", self.policy_note)
        form.addRow("Chats outgrowing the context", self.overflow)
        defaults = QGroupBox("Default sampling (sessions can override)")
        form2 = QFormLayout(defaults)
        form2.addRow("Temperature", self.temperature)
        form2.addRow("Top-p", self.top_p)
        form2.addRow("Max tokens", self.max_tokens)
        api = QGroupBox("Local API (loopback only)")
        form3 = QFormLayout(api)
        form3.addRow(self.api_enabled)
        form3.addRow("Port", self.api_port)
        form3.addRow("API key", self.api_key)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        for w in (engine, own, defaults, api, self.error, buttons):
            layout.addWidget(w)
        self._show_cache_cost()

    def _show_profile(self) -> None:
        """The chosen model's remembered settings in the fields (none: left as they are)."""
        model = self._model_value()
        if model not in self._profiles:
            return
        s = with_profile(self.values(), model, self._profiles)
        self.storage.setCurrentText(s["storage"])
        self.cache.setText(str(s["cache"]))
        self.policy.setCurrentText(s["policy"])
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(s["context_overflow"])))

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Model file", "", "GGUF (*.gguf)")
        if path:
            self.model.addItem(path, path)
            self.model.setCurrentIndex(self.model.count() - 1)

    def _set_note(self, text: str) -> None:
        self.policy_note.setText(text)
        self._fit_note()

    def _fit_note(self) -> None:
        # A form row takes a wrapped label's one-line height; this one asks for the
        # height its text needs at the width it has (the field column's, before layout).
        width = self.policy_note.width() if self.policy_note.isVisible() else 260
        self.policy_note.setMinimumHeight(self.policy_note.heightForWidth(width))

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self._fit_note()

    def _show_cache_cost(self) -> None:
        """What the cache size means for the chosen model: MiB and share of its experts."""
        entry = self._entries.get(self._model_value())
        spec = self.cache.text().strip()
        limited = bool(self.memory.text().strip())
        self.cache.setEnabled(not limited)  # the limit sizes the cache (settings.engine_config)
        if entry is None or not entry.n_experts:
            self.cache_cost.setText("")
            return
        if limited:
            self.cache_cost.setText(
                "what the memory limit leaves for experts (all of them: "
                f"{entry.experts_total_bytes / 2**30:.2f} GiB)"
            )
            return
        if spec == AUTO:
            _, free = system_memory()
            self.cache_cost.setText(
                f"every expert ({entry.experts_total_bytes / 2**30:.2f} GiB) if they fit "
                f"in free memory ({free / 2**30:.1f} GiB now)"
            )
            return
        try:
            held = entry.cache_bytes(spec)
        except ValueError:
            self.cache_cost.setText("not a size: auto, 30%, 0.3, 288 (experts) or 512MiB")
            return
        share = 100 * held / entry.experts_total_bytes if entry.experts_total_bytes else 0
        self.cache_cost.setText(
            f"≈ {held / 2**20:,.0f} MiB ({share:.0f} % of "
            f"{entry.experts_total_bytes / 2**30:.2f} GiB of experts)"
        )

    def _model_value(self) -> str:
        """The chosen model's path ("" for the demo MoE), picked or typed."""
        data = self.model.currentData()
        text = self.model.currentText().strip()
        model = (
            data
            if data is not None and text == self.model.itemText(self.model.currentIndex())
            else text
        )
        return model or ""

    def values(self) -> dict:
        return {
            **self._settings,
            "model": self._model_value(),
            "device": self.device.currentText(),
            "storage": self.storage.currentText(),
            "cache": self.cache.text().strip(),
            "memory": self.memory.text().strip(),
            "policy": self.policy.currentText(),
            "context_overflow": self.overflow.currentData(),
            "max_active": self.max_active.value(),
            "temperature": self.temperature.value(),
            "top_p": self.top_p.value(),
            "max_tokens": self.max_tokens.value(),
            "api_enabled": self.api_enabled.isChecked(),
            "api_port": self.api_port.value(),
            "api_key": self.api_key.text(),
        }

    def accept(self) -> None:
        try:
            v = self.values()
            engine_config(v)
            sampling(v)
        except ValueError as exc:
            self.error.setText(str(exc))
            return
        super().accept()
